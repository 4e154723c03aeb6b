//! hyper's own answers, made the gateway's: a request head hyper cannot parse (a bad method, header, URI or version:
//! 400; a head over its buffer: 431; a URI too long: 414) is answered by hyper itself, without calling the gateway,
//! so the answer had none of the `Proxy-Status` every other gateway error carries. [`ClientIo`] wraps a client
//! connection and adds it to such an answer as it is written.
//!
//! hyper writes that answer at a message boundary, alone, in one write, and in one shape: the status line,
//! `connection: close` (when it closes the connection after, which it does), `content-length: 0`,
//! `date: <29 characters>` and the blank line, nothing after. A write of exactly that shape is
//! rewritten; any other passes untouched. Once the connection carries a tunnel (its CONNECT was answered 200), every
//! byte is the site's and nothing is looked at.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::status::GatewayError;

/// A client connection whose hyper-made error answers gain `Proxy-Status`.
pub struct ClientIo<T> {
    inner: T,
    /// Set once the connection carries a tunnel: from then on the bytes are the site's.
    tunnelled: Arc<AtomicBool>,
    /// A rewritten answer being written, and how much of it is written, for the write hyper made of `original` bytes.
    pending: Option<(Vec<u8>, usize, usize)>,
}

impl<T> ClientIo<T> {
    /// Wraps `inner`; `tunnelled` is set by the gateway when the connection becomes a tunnel.
    pub fn new(inner: T, tunnelled: Arc<AtomicBool>) -> Self {
        Self { inner, tunnelled, pending: None }
    }

    /// The connection itself, for a tunnel: nothing of its bytes is looked at any more.
    pub fn into_inner(self) -> T {
        self.inner
    }
}

/// The answer hyper wrote for a head it could not parse, with `Proxy-Status` added, or `None` when `written` is not
/// such an answer.
pub fn with_proxy_status(written: &[u8]) -> Option<Vec<u8>> {
    let rest = written.strip_prefix(b"HTTP/1.1 ")?;
    let (details, rest) = if let Some(rest) = rest.strip_prefix(b"400 Bad Request\r\n") {
        ("the request head could not be parsed: a malformed request line, header or version", rest)
    } else if let Some(rest) = rest.strip_prefix(b"431 Request Header Fields Too Large\r\n") {
        ("the request head is larger than the gateway reads", rest)
    } else if let Some(rest) = rest.strip_prefix(b"414 URI Too Long\r\n") {
        ("the request's URI is longer than the gateway reads", rest)
    } else {
        return None;
    };
    let rest = rest.strip_prefix(b"connection: close\r\n").unwrap_or(rest);
    let date = rest.strip_prefix(b"content-length: 0\r\ndate: ")?.strip_suffix(b"\r\n\r\n")?;
    if date.len() != 29 || date.contains(&b'\r') {
        return None;
    }
    let status_line = written.iter().position(|byte| *byte == b'\n').map_or(0, |end| end + 1);
    let header = format!("proxy-status: {}\r\n", GatewayError::bad_request(details).proxy_status());
    let mut rewritten = Vec::with_capacity(written.len() + header.len());
    rewritten.extend_from_slice(&written[..status_line]);
    rewritten.extend_from_slice(header.as_bytes());
    rewritten.extend_from_slice(&written[status_line..]);
    Some(rewritten)
}

impl<T: AsyncWrite + Unpin> ClientIo<T> {
    /// Writes the pending rewritten answer on; `Ready(n)` (the `n` bytes hyper gave) once all of it is written.
    fn poll_pending(&mut self, context: &mut Context<'_>) -> Poll<io::Result<usize>> {
        while let Some((bytes, written, original)) = &mut self.pending {
            if *written == bytes.len() {
                let original = *original;
                self.pending = None;
                return Poll::Ready(Ok(original));
            }
            match Pin::new(&mut self.inner).poll_write(context, &bytes[*written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *written += n,
                other => return other,
            }
        }
        Poll::Ready(Ok(0))
    }

    /// Starts rewriting `buf` when it is one of hyper's answers; whether it was.
    fn rewrites(&mut self, buf: &[u8]) -> bool {
        if self.pending.is_some() {
            return true;
        }
        if self.tunnelled.load(Ordering::Relaxed) || !buf.starts_with(b"HTTP/1.1 4") {
            return false;
        }
        match with_proxy_status(buf) {
            Some(rewritten) => {
                self.pending = Some((rewritten, 0, buf.len()));
                true
            }
            None => false,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ClientIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, context: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(context, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ClientIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, context: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        if self.rewrites(buf) {
            return self.poll_pending(context);
        }
        Pin::new(&mut self.inner).poll_write(context, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // hyper's answer is one buffer; anything written in several is not it.
        let mut filled = bufs.iter().filter(|buf| !buf.is_empty());
        if let (Some(only), None) = (filled.next(), filled.next())
            && self.rewrites(only)
        {
            return self.poll_pending(context);
        }
        Pin::new(&mut self.inner).poll_write_vectored(context, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(context)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(context)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DATE: &str = "Mon, 07 Dec 2026 05:00:00 GMT";

    #[test]
    fn hypers_answers_gain_proxy_status_and_nothing_else_changes() {
        for status in ["400 Bad Request", "431 Request Header Fields Too Large", "414 URI Too Long"] {
            for close in ["connection: close\r\n", ""] {
                let written = format!("HTTP/1.1 {status}\r\n{close}content-length: 0\r\ndate: {DATE}\r\n\r\n");
                let rewritten = String::from_utf8(with_proxy_status(written.as_bytes()).expect("rewritten")).unwrap();
                let expected = format!("HTTP/1.1 {status}\r\nproxy-status: egress-gateway; error=http_request_error; ");
                assert!(rewritten.starts_with(&expected), "{rewritten}");
                let rest = format!("\"\r\n{close}content-length: 0\r\ndate: {DATE}\r\n\r\n");
                assert!(rewritten.ends_with(&rest), "{rewritten}");
            }
        }
        for other in [
            // A body after the head, another header, another status or version, a cut head: not hyper's answer.
            format!("HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: {DATE}\r\n\r\nx"),
            format!("HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nserver: x\r\ndate: {DATE}\r\n\r\n"),
            format!("HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\ndate: {DATE}\r\n\r\n"),
            format!("HTTP/1.0 400 Bad Request\r\ncontent-length: 0\r\ndate: {DATE}\r\n\r\n"),
            "HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n".to_owned(),
        ] {
            assert_eq!(with_proxy_status(other.as_bytes()), None, "{other}");
        }
    }
}
