//! The exports a server offers: a name, a volume handle, and whether writes are allowed.

use std::collections::BTreeMap;
use std::sync::Arc;

use ferrite_engine::Volume;
use parking_lot::RwLock;

use crate::metrics::ExportMetrics;

/// One export: a volume under a name.
#[derive(Debug)]
pub struct Export {
    pub name: String,
    pub volume: Volume,
    pub read_only: bool,
    pub description: String,
    pub metrics: ExportMetrics,
}

impl Export {
    pub fn new(name: impl Into<String>, volume: Volume, read_only: bool, description: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            volume,
            read_only,
            description: description.into(),
            metrics: ExportMetrics::default(),
        }
    }
}

/// The set of exports, shared by every listener and changed by the admin API at run time.
#[derive(Debug, Default)]
pub struct Exports {
    map: RwLock<BTreeMap<String, Arc<Export>>>,
}

impl Exports {
    /// Adds (or replaces) an export; connections already open keep the one they negotiated.
    pub fn add(&self, export: Export) -> Arc<Export> {
        let e = Arc::new(export);
        self.map.write().insert(e.name.clone(), Arc::clone(&e));
        e
    }

    /// Removes an export by name; returns whether it existed.
    pub fn remove(&self, name: &str) -> bool {
        self.map.write().remove(name).is_some()
    }

    pub fn get(&self, name: &str) -> Option<Arc<Export>> {
        self.map.read().get(name).cloned()
    }

    /// Every export, by name.
    pub fn list(&self) -> Vec<Arc<Export>> {
        self.map.read().values().cloned().collect()
    }
}
