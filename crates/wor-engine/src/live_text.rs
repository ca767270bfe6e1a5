//! A run's model text as it is written, for people watching (`GET /v1/runs/{id}/events`).
//!
//! Deltas pass through a [`StreamRedactor`] (the run's live secrets and secret shapes, with a
//! held-back tail, so a secret split across deltas is caught) before anyone sees them. Nothing
//! here is stored or decides anything: the stored model turn is the provider's assembled
//! response, written whole. Watchers are in this process only; a subscriber of another
//! process sees the steps, not the deltas.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::broadcast;
use wor_core::RunId;
use wor_models::StreamSink;
use wor_secrets::StreamRedactor;

/// Deltas buffered per watcher before the slowest one starts losing them.
const CHANNEL_CAPACITY: usize = 256;

/// The runs being watched, each with the channel its redacted text goes out on.
#[derive(Debug, Default, Clone)]
pub struct LiveText {
    runs: Arc<Mutex<HashMap<RunId, broadcast::Sender<String>>>>,
}

impl LiveText {
    /// Redacted text deltas of `run`'s model calls from now on.
    pub fn subscribe(&self, run: RunId) -> broadcast::Receiver<String> {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.entry(run)
            .or_insert_with(|| broadcast::channel(CHANNEL_CAPACITY).0)
            .subscribe()
    }

    fn publish(&self, run: RunId, text: String) {
        if text.is_empty() {
            return;
        }
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(sender) = runs.get(&run) {
            if sender.receiver_count() == 0 {
                runs.remove(&run);
            } else {
                // A watcher gone since is no error.
                let _ = sender.send(text);
            }
        }
    }

    /// Forgets `run` (it ended): its watchers see their channel close.
    pub(crate) fn close(&self, run: RunId) {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.remove(&run);
    }

    /// The sink one model call of `run` writes its text to.
    pub(crate) fn sink<'r>(&self, run: RunId, redactor: StreamRedactor<'r>) -> LiveSink<'r> {
        LiveSink {
            live: self.clone(),
            run,
            redactor,
        }
    }
}

/// The [`StreamSink`] of one model call: redacts and publishes.
#[derive(Debug)]
pub(crate) struct LiveSink<'r> {
    live: LiveText,
    run: RunId,
    redactor: StreamRedactor<'r>,
}

impl LiveSink<'_> {
    /// Lets out the held-back tail once the call has ended.
    pub(crate) fn finish(self) {
        let rest = self.redactor.finish();
        self.live.publish(self.run, rest);
    }
}

impl StreamSink for LiveSink<'_> {
    fn text_delta(&mut self, delta: &str) {
        let out = self.redactor.push(delta);
        self.live.publish(self.run, out);
    }
}
