//! Data-key rotations (a volume re-encrypted under a new data key, `ferrite_engine`'s
//! `ops/rotation.rs`) as background jobs: one per volume, its progress for `volume show`, a
//! record in the data directory (`rotations.json`) so a job cut by a restart resumes once its
//! volume is unlocked again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use ferrite_crypt::Kek;
use ferrite_engine::{Pool, RotationProgress};

use crate::base::error::{Error, blocking};
use crate::base::state::RecordFile;

/// A rotation's state, as status shows it.
#[derive(Debug, Clone, Default)]
pub struct Job {
    pub running: bool,
    pub progress: Option<RotationProgress>,
    pub error: Option<String>,
}

#[derive(Debug)]
pub struct Rotations {
    pool: Arc<Pool>,
    file: RecordFile,
    /// Volumes with a rotation not finished (the record), and each one's state.
    jobs: Mutex<HashMap<String, Job>>,
}

impl Rotations {
    /// Loads the unfinished rotations and resumes those whose volume is unlocked.
    pub fn restore(pool: Arc<Pool>, data_dir: &std::path::Path) -> anyhow::Result<Arc<Self>> {
        let file = RecordFile::new(data_dir, "rotations");
        let names: Vec<String> = file.load()?;
        let me = Arc::new(Self { pool, file, jobs: Mutex::new(HashMap::new()) });
        for name in names {
            me.jobs.lock().expect("not poisoned").insert(name.clone(), Job::default());
            if me.pool.volume_info(&name).is_ok_and(|v| v.encryption.is_some_and(|e| e.unlocked)) {
                me.spawn(name);
            } else {
                tracing::warn!(volume = %name, "data key rotation waits until the volume is unlocked");
            }
        }
        Ok(me)
    }

    fn save(&self) -> Result<(), Error> {
        let names: Vec<String> = self.jobs.lock().expect("not poisoned").keys().cloned().collect();
        self.file.save(&names).map_err(|e| Error::internal(format!("recording rotations: {e}")))
    }

    /// Starts re-encrypting volume `name` under a new data key wrapped by `kek` (which must
    /// wrap its current one); returns at once, the job runs on. A running one is left alone.
    pub async fn start(self: &Arc<Self>, name: &str, kek: Kek) -> Result<(), Error> {
        let unfinished = match self.jobs.lock().expect("not poisoned").get(name) {
            Some(j) if j.running => return Ok(()),
            j => j.is_some(),
        };
        let (pool, n) = (Arc::clone(&self.pool), name.to_owned());
        if !unfinished {
            blocking(move || {
                // The key wraps the current data key whatever id the volume records for it.
                pool.start_data_key_rotation(&n, |id| kek.with_id(id))
            })
            .await?;
            self.jobs.lock().expect("not poisoned").insert(name.to_owned(), Job::default());
            self.save()?;
        }
        self.spawn(name.to_owned());
        Ok(())
    }

    /// Resumes an unfinished rotation of `name` (after it was unlocked).
    pub fn resume(self: &Arc<Self>, name: &str) {
        if self.jobs.lock().expect("not poisoned").get(name).is_some_and(|j| !j.running) {
            self.spawn(name.to_owned());
        }
    }

    fn spawn(self: &Arc<Self>, name: String) {
        let me = Arc::clone(self);
        if let Some(j) = me.jobs.lock().expect("not poisoned").get_mut(&name) {
            *j = Job { running: true, ..Job::default() };
        }
        tokio::task::spawn_blocking(move || {
            let r = me.pool.run_data_key_rotation(&name, |p| {
                if let Some(j) = me.jobs.lock().expect("not poisoned").get_mut(&name) {
                    j.progress = Some(p);
                }
            });
            match r {
                Ok(()) => {
                    me.jobs.lock().expect("not poisoned").remove(&name);
                    if let Err(e) = me.save() {
                        tracing::warn!(volume = %name, "{}", e.message());
                    }
                    tracing::info!(volume = %name, "data key rotation finished");
                }
                Err(e) => {
                    tracing::warn!(volume = %name, error = %e, "data key rotation stopped; it resumes when started again");
                    if let Some(j) = me.jobs.lock().expect("not poisoned").get_mut(&name) {
                        j.running = false;
                        j.error = Some(Error::from(e).message().to_owned());
                    }
                }
            }
        });
    }

    /// The state of `name`'s rotation, if one is unfinished.
    pub fn job(&self, name: &str) -> Option<Job> {
        self.jobs.lock().expect("not poisoned").get(name).cloned()
    }
}
