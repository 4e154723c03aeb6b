//! A log writer that keeps everything written to it, for tests that read what a subscriber wrote (that no secret
//! reached a log, at any level).

use std::io::Write;
use std::sync::{Arc, Mutex};

/// Everything written through any clone of it, in order. Clone it into a `tracing` subscriber's `with_writer`.
#[derive(Clone, Debug, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("the captured log").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// What was written so far, as text (invalid UTF-8 replaced).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("the captured log")).into_owned()
    }
}
