//! A stdio server's output held to the session's message limit. A line is one message; the
//! transport alone would drop a line past its limit and read on, so the request it answered
//! would wait out its whole timeout. Here such a line ends the stream instead, marked, so
//! every request in flight fails at once and says why.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// Reads `inner` until a line grows past `limit` bytes, then fails every read and sets
/// `exceeded`.
pub(crate) struct LineLimited<R> {
    inner: R,
    limit: usize,
    /// Bytes read since the last newline.
    in_line: usize,
    exceeded: Arc<AtomicBool>,
}

impl<R> LineLimited<R> {
    pub(crate) fn new(inner: R, limit: usize, exceeded: Arc<AtomicBool>) -> Self {
        Self {
            inner,
            limit,
            in_line: 0,
            exceeded,
        }
    }

    fn too_long(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a message longer than {} bytes", self.limit),
        )
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for LineLimited<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.exceeded.load(Ordering::Acquire) {
            return Poll::Ready(Err(self.too_long()));
        }
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {}
            other => return other,
        }
        let read = buf.filled().get(before..).unwrap_or_default();
        // Each segment but the last ends with a newline; the first goes on the line before.
        let mut in_line = this.in_line;
        // Where the segment being counted begins, in this read.
        let mut start = 0usize;
        let mut segments = read.split(|byte| *byte == b'\n').peekable();
        while let Some(segment) = segments.next() {
            in_line = in_line.saturating_add(segment.len());
            if in_line > this.limit {
                this.exceeded.store(true, Ordering::Release);
                if start == 0 {
                    // A failed read hands over nothing.
                    buf.set_filled(before);
                    return Poll::Ready(Err(this.too_long()));
                }
                // The whole messages before the long line are handed over; the next read
                // fails.
                buf.set_filled(before.saturating_add(start));
                return Poll::Ready(Ok(()));
            }
            if segments.peek().is_some() {
                in_line = 0;
                start = start.saturating_add(segment.len()).saturating_add(1);
            }
        }
        this.in_line = in_line;
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::AsyncReadExt as _;

    use super::LineLimited;

    async fn read_all(input: &[u8], limit: usize) -> (std::io::Result<Vec<u8>>, bool) {
        let exceeded = Arc::new(AtomicBool::new(false));
        let mut reader = LineLimited::new(input, limit, exceeded.clone());
        let mut out = Vec::new();
        let result = reader.read_to_end(&mut out).await.map(|_| out);
        (result, exceeded.load(Ordering::Acquire))
    }

    #[tokio::test]
    async fn lines_within_the_limit_pass_and_a_longer_one_ends_the_stream() {
        let (ok, exceeded) = read_all(b"12345\n1234\n123", 5).await;
        assert_eq!(ok.unwrap(), b"12345\n1234\n123");
        assert!(!exceeded);
        for input in [&b"123456"[..], b"12\n123456\n1", b"123456\n"] {
            let (refused, exceeded) = read_all(input, 5).await;
            assert!(refused.is_err(), "{input:?}");
            assert!(exceeded, "{input:?}");
        }
    }

    #[tokio::test]
    async fn the_whole_lines_before_a_long_one_are_handed_over_first() {
        let exceeded = Arc::new(AtomicBool::new(false));
        let mut reader = LineLimited::new(&b"ab\ncd\n1234567"[..], 5, exceeded.clone());
        let mut buf = [0u8; 64];
        let read = reader.read(&mut buf).await.unwrap();
        assert_eq!(buf.get(..read).unwrap(), b"ab\ncd\n");
        assert!(reader.read(&mut buf).await.is_err());
        assert!(exceeded.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_line_is_counted_across_reads() {
        let exceeded = Arc::new(AtomicBool::new(false));
        let (client, mut server) = tokio::io::duplex(4);
        let mut reader = LineLimited::new(client, 6, exceeded.clone());
        tokio::spawn(async move {
            use tokio::io::AsyncWriteExt as _;
            let _ = server.write_all(b"abcd").await;
            let _ = server.write_all(b"efg\n").await;
        });
        let mut out = Vec::new();
        assert!(reader.read_to_end(&mut out).await.is_err());
        assert!(exceeded.load(Ordering::Acquire));
    }
}
