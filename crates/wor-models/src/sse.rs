//! A server-sent events decoder for streamed model responses.
//!
//! Bytes arrive in arbitrary chunks (a line, or a UTF-8 character, may be split across two);
//! the decoder buffers them and yields one [`SseEvent`] per blank-line-terminated event. Only
//! the `event` and `data` fields matter to model providers; comments and other fields are
//! skipped. An event left incomplete when the stream ends is dropped, as the SSE standard says.

use crate::error::ModelError;

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    /// The `data:` lines, joined with `\n`.
    pub data: String,
}

/// Incremental decoder: feed chunks, take events.
#[derive(Debug, Default)]
pub(crate) struct SseDecoder {
    pending: Vec<u8>,
    /// How many bytes at the start of `pending` are known to hold no line end: a line that
    /// arrives in many chunks is searched once, not once per chunk.
    scanned: usize,
    event: Option<String>,
    data: Option<String>,
}

impl SseDecoder {
    /// Decodes `chunk`, appending every event it completes to `events`.
    pub fn feed(&mut self, chunk: &[u8], events: &mut Vec<SseEvent>) -> Result<(), ModelError> {
        self.pending.extend_from_slice(chunk);
        let mut consumed = 0;
        let mut from = self.scanned;
        while let Some(offset) = self
            .pending
            .get(from..)
            .and_then(|rest| rest.iter().position(|&b| b == b'\n'))
        {
            let end = from + offset;
            let raw = self.pending.get(consumed..end).unwrap_or_default();
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            let line = std::str::from_utf8(raw)
                .map_err(|_| ModelError::malformed("event stream line is not utf-8"))?
                .to_owned();
            consumed = end + 1;
            from = consumed;
            self.line(&line, events);
        }
        self.pending.drain(..consumed);
        self.scanned = self.pending.len();
        Ok(())
    }

    fn line(&mut self, line: &str, events: &mut Vec<SseEvent>) {
        if line.is_empty() {
            if let Some(data) = self.data.take() {
                events.push(SseEvent {
                    event: self.event.take(),
                    data,
                });
            }
            self.event = None;
            return;
        }
        if line.starts_with(':') {
            return;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        let value = value.strip_prefix(' ').unwrap_or(value);
        match field {
            "event" => self.event = Some(value.to_owned()),
            "data" => match &mut self.data {
                Some(data) => {
                    data.push('\n');
                    data.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            },
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(chunks: &[&[u8]]) -> Vec<SseEvent> {
        let mut decoder = SseDecoder::default();
        let mut events = Vec::new();
        for chunk in chunks {
            decoder.feed(chunk, &mut events).unwrap();
        }
        events
    }

    #[test]
    fn events_survive_arbitrary_chunk_boundaries() {
        let stream = "event: a\r\ndata: {\"x\":\n: a comment\ndata: \"é\"}\n\ndata: [DONE]\n\n";
        let whole = decode(&[stream.as_bytes()]);
        assert_eq!(
            whole,
            [
                SseEvent {
                    event: Some("a".into()),
                    data: "{\"x\":\n\"é\"}".into()
                },
                SseEvent {
                    event: None,
                    data: "[DONE]".into()
                },
            ]
        );
        let bytes = stream.as_bytes();
        for split in 1..bytes.len() {
            let (left, right) = bytes.split_at(split);
            assert_eq!(decode(&[left, right]), whole, "split at {split}");
        }
        let one_by_one: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(decode(&one_by_one), whole);
    }

    #[test]
    fn an_unterminated_event_is_not_emitted() {
        assert!(decode(&[b"data: {\"partial\": tr"]).is_empty());
        assert!(decode(&[b"data: complete line but no blank line\n"]).is_empty());
    }

    #[test]
    fn invalid_utf8_is_an_error_not_a_panic() {
        let mut decoder = SseDecoder::default();
        let err = decoder
            .feed(b"data: \xff\xfe\n\n", &mut Vec::new())
            .unwrap_err();
        assert!(err.to_string().contains("not utf-8"));
    }
}
