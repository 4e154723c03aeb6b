//! A local HTTP origin for requests sent through proxies, and a minimal proxy client.
//!
//! The origin answers every request with `200 ok` (or, at `/ip`, the caller's address as a bare IP, as IP-echo
//! services do) and counts what it served, so a test can assert that probes stopped. The client speaks just enough
//! HTTP/1.1 to send an absolute-form GET through a forward proxy and read the status code.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A running origin; dropping it stops it.
pub struct LocalOrigin {
    address: SocketAddr,
    requests: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl LocalOrigin {
    /// Starts an origin on a free port of 127.0.0.1.
    pub async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.context("binding the local origin")?;
        let address = listener.local_addr()?;
        let requests = Arc::new(AtomicU64::new(0));
        let counter = requests.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, peer)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    let _ = serve(stream, peer, &counter).await;
                });
            }
        });
        Ok(Self { address, requests, task })
    }

    /// `http://127.0.0.1:<port>/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.address)
    }

    /// Where it listens.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// How many requests it has answered.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for LocalOrigin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(mut stream: TcpStream, peer: SocketAddr, counter: &AtomicU64) -> Result<()> {
    let head = read_head(&mut stream).await?;
    counter.fetch_add(1, Ordering::SeqCst);
    let path = head.split_whitespace().nth(1).unwrap_or("/");
    let body = if path.ends_with("/ip") { peer.ip().to_string() } else { "ok".to_owned() };
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

async fn read_head(stream: &mut TcpStream) -> Result<String> {
    let mut buffer = Vec::with_capacity(1024);
    let mut chunk = [0_u8; 1024];
    while !buffer.windows(4).any(|window| window == b"\r\n\r\n") {
        let read = stream.read(&mut chunk).await?;
        if read == 0 || buffer.len() > 64 * 1024 {
            bail!("the request ended before its headers did");
        }
        buffer.extend_from_slice(&chunk[..read]);
    }
    Ok(String::from_utf8_lossy(&buffer).into_owned())
}

/// Sends `GET url` through the forward proxy at `proxy`, with basic credentials when given, and returns the HTTP
/// status code the proxy answered with.
pub async fn get_through_proxy(proxy: SocketAddr, url: &str, credentials: Option<(&str, &str)>) -> Result<u16> {
    let exchange = async {
        let mut stream = TcpStream::connect(proxy).await.with_context(|| format!("connecting to the proxy {proxy}"))?;
        let host = url.split("://").nth(1).and_then(|rest| rest.split('/').next()).unwrap_or_default();
        let mut request = format!("GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
        if let Some((user, password)) = credentials {
            request.push_str(&format!(
                "Proxy-Authorization: Basic {}\r\n",
                base64(format!("{user}:{password}").as_bytes())
            ));
        }
        request.push_str("\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        let text = String::from_utf8_lossy(&response);
        let status = text.split_whitespace().nth(1).context("the proxy sent no status line")?;
        status.parse::<u16>().with_context(|| format!("{status:?} is not a status code"))
    };
    tokio::time::timeout(Duration::from_secs(20), exchange).await.context("the request through the proxy timed out")?
}

/// Standard base64 with padding, for the Proxy-Authorization header.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0_u32, |n, (index, byte)| n | (u32::from(*byte) << (16 - 8 * index)));
        for index in 0..4 {
            if index <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * index)) & 0x3f) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_the_rfc_examples() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (input, expected) in cases {
            assert_eq!(base64(input.as_bytes()), expected, "{input:?}");
        }
    }
}
