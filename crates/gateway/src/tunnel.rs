//! Copying a tunnel's bytes both ways, with buffers sized by the traffic: none while the tunnel idles, a small one
//! for the first read after it wakes, a large one once a read fills the small one (a download streaming), back to
//! none when the tunnel goes quiet again.
//!
//! `tokio::io::copy_bidirectional` keeps two fixed buffers for a tunnel's whole life: small ones make a streaming
//! tunnel pay a system call per few kilobytes, large ones make ten thousand idle tunnels cost a gigabyte. Here an idle
//! tunnel holds no buffer at all, and a busy one reads 64 KiB at a time.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The buffer sizes of a tunnel's two directions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buffers {
    /// The buffer a direction reads into after idling.
    pub small: usize,
    /// The buffer it reads into once a read filled the small one.
    pub large: usize,
}

impl Default for Buffers {
    fn default() -> Self {
        Self { small: 4096, large: 65_536 }
    }
}

/// One direction: bytes read from one side and not yet written to the other.
struct Direction {
    buffer: Vec<u8>,
    /// What the next read is made into when no buffer is held.
    next: usize,
    sizes: Buffers,
    start: usize,
    end: usize,
    /// The reading side reached its end.
    finished: bool,
    /// Written since the last flush.
    unflushed: bool,
    /// The writing side was shut down after the end.
    shut: bool,
    copied: u64,
}

impl Direction {
    fn new(sizes: Buffers) -> Self {
        Self {
            buffer: Vec::new(),
            next: sizes.small,
            sizes,
            start: 0,
            end: 0,
            finished: false,
            unflushed: false,
            shut: false,
            copied: 0,
        }
    }

    /// Moves bytes from `reader` to `writer` until the reader waits or ends; `Ready` once the reader has ended,
    /// everything read is written and the writer is shut down.
    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        mut reader: Pin<&mut R>,
        mut writer: Pin<&mut W>,
    ) -> Poll<io::Result<u64>>
    where
        R: AsyncRead + ?Sized,
        W: AsyncWrite + ?Sized,
    {
        loop {
            if self.start == self.end && !self.finished {
                if self.buffer.len() != self.next {
                    self.buffer = vec![0; self.next];
                }
                let mut read = ReadBuf::new(&mut self.buffer);
                match reader.as_mut().poll_read(cx, &mut read) {
                    Poll::Pending => {
                        if self.unflushed {
                            ready!(writer.as_mut().poll_flush(cx))?;
                            self.unflushed = false;
                        }
                        // Quiet: hold nothing until the next read, and start that one small.
                        self.buffer = Vec::new();
                        self.next = self.sizes.small;
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                    Poll::Ready(Ok(())) => {
                        let filled = read.filled().len();
                        if filled == 0 {
                            self.finished = true;
                            self.buffer = Vec::new();
                        } else {
                            // A full read means more is waiting: read the rest in large pieces.
                            if filled == self.buffer.len() {
                                self.next = self.sizes.large;
                            }
                            self.start = 0;
                            self.end = filled;
                        }
                    }
                }
            }
            while self.start < self.end {
                let written = ready!(writer.as_mut().poll_write(cx, &self.buffer[self.start..self.end]))?;
                if written == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                self.start += written;
                self.copied += written as u64;
                self.unflushed = true;
            }
            if self.finished {
                if !self.shut {
                    ready!(writer.as_mut().poll_flush(cx))?;
                    ready!(writer.as_mut().poll_shutdown(cx))?;
                    self.shut = true;
                }
                return Poll::Ready(Ok(self.copied));
            }
        }
    }

    /// The bytes this direction holds now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.buffer.capacity()
    }
}

/// Copies `a` to `b` and `b` to `a` until both have ended (each end shuts down the other side's writing half);
/// the bytes copied each way.
///
/// # Errors
/// The first read or write error of either direction.
pub async fn splice<A, B>(a: &mut A, b: &mut B, sizes: Buffers) -> io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let (mut a_to_b, mut b_to_a) = (Direction::new(sizes), Direction::new(sizes));
    let (mut forward, mut backward) = (None, None);
    poll_fn(|cx| {
        if forward.is_none()
            && let Poll::Ready(result) = a_to_b.poll_copy(cx, Pin::new(&mut *a), Pin::new(&mut *b))
        {
            forward = Some(result?);
        }
        if backward.is_none()
            && let Poll::Ready(result) = b_to_a.poll_copy(cx, Pin::new(&mut *b), Pin::new(&mut *a))
        {
            backward = Some(result?);
        }
        match (forward, backward) {
            (Some(forward), Some(backward)) => Poll::Ready(Ok((forward, backward))),
            _ => Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt, duplex};

    use super::*;

    #[tokio::test]
    async fn bytes_cross_both_ways_and_ends_propagate() {
        let (client, mut near) = duplex(1 << 16);
        let (mut far, server) = duplex(1 << 16);
        let copying = tokio::spawn(async move { splice(&mut near, &mut far, Buffers::default()).await });
        let upload: Vec<u8> = (0..3_000_000_u32).map(|index| (index % 251) as u8).collect();
        let download: Vec<u8> = upload.iter().rev().copied().collect();
        let (sent_up, sent_down) = (upload.clone(), download.clone());
        let client_side = tokio::spawn(async move {
            let (mut reader, mut writer) = tokio::io::split(client);
            let writing = tokio::spawn(async move {
                writer.write_all(&sent_up).await.expect("upload");
                writer.shutdown().await.expect("end of upload");
            });
            let mut received = Vec::new();
            reader.read_to_end(&mut received).await.expect("download");
            writing.await.expect("writer");
            received
        });
        let (mut reader, mut writer) = tokio::io::split(server);
        let server_writing = tokio::spawn(async move {
            writer.write_all(&sent_down).await.expect("download");
            writer.shutdown().await.expect("end of download");
        });
        let mut received = Vec::new();
        reader.read_to_end(&mut received).await.expect("upload");
        server_writing.await.expect("server writer");
        assert_eq!(received, upload, "the upload arrived whole and in order");
        assert_eq!(client_side.await.expect("client"), download, "the download arrived whole and in order");
        let (up, down) = copying.await.expect("splice").expect("no error");
        assert_eq!((up, down), (upload.len() as u64, download.len() as u64));
    }

    #[tokio::test]
    async fn an_idle_direction_holds_no_buffer_and_starts_small_again() {
        let sizes = Buffers { small: 16, large: 64 };
        let mut direction = Direction::new(sizes);
        let (mut source, mut reader) = duplex(1024);
        let (mut writer, mut sink) = duplex(1024);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(direction.poll_copy(&mut cx, Pin::new(&mut reader), Pin::new(&mut writer)).is_pending());
        assert_eq!(direction.held(), 0, "nothing to read: no buffer held");
        source.write_all(&[7; 100]).await.expect("write");
        assert!(direction.poll_copy(&mut cx, Pin::new(&mut reader), Pin::new(&mut writer)).is_pending());
        assert_eq!(direction.held(), 0, "drained: the buffer is let go again");
        let mut copied = vec![0; 100];
        sink.read_exact(&mut copied).await.expect("the copy");
        assert_eq!(copied, vec![7; 100]);
        assert_eq!(direction.next, sizes.small, "after idling, the next read starts small");
    }
}
