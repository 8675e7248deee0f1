//! One operation per volume at a time: a second call on a volume while the first is still running
//! gets Aborted, as the spec asks, and the CO retries it later.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use tonic::Status;

#[derive(Debug, Default, Clone)]
pub struct Busy(Arc<Mutex<HashSet<String>>>);

/// Held while an operation on `key` runs; dropping it lets the next one in.
#[derive(Debug)]
pub struct Guard {
    set: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl Busy {
    pub fn begin(&self, key: &str) -> Result<Guard, Status> {
        let mut set = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !set.insert(key.to_owned()) {
            return Err(Status::aborted(format!("an operation on {key} is already in progress")));
        }
        Ok(Guard { set: Arc::clone(&self.0), key: key.to_owned() })
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.set.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_operation_on_a_volume_is_aborted_until_the_first_ends() {
        let b = Busy::default();
        let g = b.begin("node-a/v1").unwrap();
        assert_eq!(b.begin("node-a/v1").unwrap_err().code(), tonic::Code::Aborted);
        let _other = b.begin("node-a/v2").unwrap();
        drop(g);
        b.begin("node-a/v1").unwrap();
    }
}
