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

/// How much of a model call's redacted text is kept for a watcher who comes after it began.
/// A call that writes more keeps none, and such a watcher sees its text from when it came.
const KEPT_TEXT_BYTES: usize = 64 * 1024;

/// The runs whose model call is under way or that someone watches, each with the text of
/// the call so far and the channel its redacted text goes out on.
#[derive(Debug, Default, Clone)]
pub struct LiveText {
    runs: Arc<Mutex<HashMap<RunId, Live>>>,
}

/// One run's text: the model call's so far (while one is under way), and its watchers.
#[derive(Debug)]
struct Live {
    /// The redacted text the call under way has written; empty between calls, and once it
    /// passed [`KEPT_TEXT_BYTES`] (with `kept` false).
    so_far: String,
    kept: bool,
    /// Whether a model call of the run is under way.
    calling: bool,
    watchers: broadcast::Sender<String>,
}

impl Live {
    fn new() -> Self {
        Live {
            so_far: String::new(),
            kept: true,
            calling: false,
            watchers: broadcast::channel(CHANNEL_CAPACITY).0,
        }
    }

    /// Whether nothing needs the entry: no call under way, no one watching.
    fn idle(&self) -> bool {
        !self.calling && self.watchers.receiver_count() == 0
    }
}

/// What a watcher of a run's text is given: the redacted text the model call under way has
/// written so far (empty when none is, or when it wrote too much to keep), then each
/// redacted delta after it.
#[derive(Debug)]
pub struct TextWatch {
    pub so_far: String,
    pub deltas: broadcast::Receiver<String>,
}

impl LiveText {
    /// `run`'s text from now on, with what its model call under way has written so far.
    pub fn subscribe(&self, run: RunId) -> TextWatch {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        // Runs watched before and no longer (one driven elsewhere, whose call never began
        // here) are forgotten: the map holds the calls under way and the watched runs.
        runs.retain(|_, live| !live.idle());
        let live = runs.entry(run).or_insert_with(Live::new);
        TextWatch {
            so_far: live.so_far.clone(),
            deltas: live.watchers.subscribe(),
        }
    }

    /// A model call of `run` begins: its text is kept from here.
    fn call_began(&self, run: RunId) {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        let live = runs.entry(run).or_insert_with(Live::new);
        live.so_far.clear();
        live.kept = true;
        live.calling = true;
    }

    /// The model call of `run` has ended: its turn is recorded next, and its text is no
    /// longer kept.
    fn call_ended(&self, run: RunId) {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(live) = runs.get_mut(&run) {
            live.so_far = String::new();
            live.calling = false;
            if live.idle() {
                runs.remove(&run);
            }
        }
    }

    fn publish(&self, run: RunId, text: String) {
        if text.is_empty() {
            return;
        }
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(live) = runs.get_mut(&run) else {
            return;
        };
        if live.kept {
            if live.so_far.len() + text.len() <= KEPT_TEXT_BYTES {
                live.so_far.push_str(&text);
            } else {
                live.so_far = String::new();
                live.kept = false;
            }
        }
        if live.watchers.receiver_count() > 0 {
            // A watcher gone since is no error.
            let _ = live.watchers.send(text);
        }
    }

    /// Forgets `run` (it ended): its watchers see their channel close.
    pub(crate) fn close(&self, run: RunId) {
        let mut runs = self.runs.lock().unwrap_or_else(PoisonError::into_inner);
        runs.remove(&run);
    }

    /// The sink one model call of `run` writes its text to.
    pub(crate) fn sink<'r>(&self, run: RunId, redactor: StreamRedactor<'r>) -> LiveSink<'r> {
        self.call_began(run);
        LiveSink {
            live: self.clone(),
            run,
            redactor: Some(redactor),
        }
    }
}

/// The [`StreamSink`] of one model call: redacts and publishes. Dropped, with or without
/// [`LiveSink::finish`] (a call given up midway), it ends the call's kept text.
#[derive(Debug)]
pub(crate) struct LiveSink<'r> {
    live: LiveText,
    run: RunId,
    /// `None` once finished.
    redactor: Option<StreamRedactor<'r>>,
}

impl LiveSink<'_> {
    /// Lets out the held-back tail once the call has ended.
    pub(crate) fn finish(mut self) {
        if let Some(redactor) = self.redactor.take() {
            self.live.publish(self.run, redactor.finish());
        }
    }
}

impl Drop for LiveSink<'_> {
    fn drop(&mut self) {
        self.live.call_ended(self.run);
    }
}

impl StreamSink for LiveSink<'_> {
    fn text_delta(&mut self, delta: &str) {
        if let Some(redactor) = self.redactor.as_mut() {
            let out = redactor.push(delta);
            self.live.publish(self.run, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wor_secrets::Redactor;

    const SECRET: &str = "correct-horse-battery-staple";

    fn received(watch: &mut TextWatch) -> String {
        let mut text = String::new();
        while let Ok(delta) = watch.deltas.try_recv() {
            text.push_str(&delta);
        }
        text
    }

    fn tracked(live: &LiveText) -> usize {
        live.runs.lock().unwrap().len()
    }

    #[test]
    fn a_watcher_who_comes_mid_call_is_given_the_text_so_far_redacted_then_the_rest() {
        let live = LiveText::default();
        let run = RunId::new();
        let redactor = Redactor::new([SECRET]).unwrap();
        let mut sink = live.sink(run, redactor.stream());
        sink.text_delta("The password is correct-horse-");
        sink.text_delta("battery-staple and the rest ");
        let mut late = live.subscribe(run);
        assert!(
            late.so_far.starts_with("The password is "),
            "{}",
            late.so_far
        );
        sink.text_delta("comes after.");
        sink.finish();
        let rest = received(&mut late);
        let whole = format!("{}{rest}", late.so_far);
        assert_eq!(
            whole,
            "The password is [REDACTED] and the rest comes after."
        );
        assert!(!whole.contains("horse"), "{whole}");
        // The call has ended: a watcher now is given nothing of it (its turn is recorded).
        assert_eq!(live.subscribe(run).so_far, "");
    }

    #[test]
    fn text_is_kept_only_while_a_call_is_under_way_and_up_to_its_bound() {
        let live = LiveText::default();
        let run = RunId::new();
        let redactor = Redactor::new(Vec::<String>::new()).unwrap();
        {
            let mut sink = live.sink(run, redactor.stream());
            sink.text_delta("a call given up midway ");
            assert_eq!(tracked(&live), 1);
        }
        // Dropped without finishing, and no one watching: nothing of the run is held.
        assert_eq!(tracked(&live), 0);

        let mut sink = live.sink(run, redactor.stream());
        let word = "word ".repeat(1024);
        for _ in 0..(KEPT_TEXT_BYTES / word.len() + 1) {
            sink.text_delta(&word);
        }
        // Past the bound the call keeps nothing: a watcher now sees its text from here.
        let mut late = live.subscribe(run);
        assert_eq!(late.so_far, "");
        sink.text_delta("end.");
        sink.finish();
        assert!(received(&mut late).ends_with("end."));
        drop(late);
        // A run watched once and no longer is forgotten at the next watch of another run.
        let other = live.subscribe(RunId::new());
        assert_eq!(tracked(&live), 1);
        drop(other);
    }
}
