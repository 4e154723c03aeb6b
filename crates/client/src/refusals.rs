//! Following a tenant's refusals: the stream `GET /v1/refusals` sends (newline-delimited JSON), read line by line.

use std::time::Duration;

use http_body_util::BodyExt;
use serde::Deserialize;

use crate::{ClientError, ProxyId, transport};

/// What a refusal stream ([`DiscoveryClient::refusals`]) says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefusalEvent {
    /// `proxies` cool down for `target` until `until` (RFC 3339): a site refused one of them, as the tenant reported.
    Refused {
        /// The normalised site.
        target: String,
        /// The reported proxy and those leaving through its egress address.
        proxies: Vec<ProxyId>,
        /// When the cooldown ends.
        until: String,
    },
    /// The live cooldowns the stream started with have all been sent.
    Synced,
}

/// One line of the stream, as sent.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "camelCase")]
enum RefusalLine {
    Refusal { target: String, proxies: Vec<String>, until: String },
    Synced,
    Heartbeat,
}

/// How long a refusal stream may stay silent: the server sends a heartbeat every 10 s, so three missed ones mean the
/// connection is gone.
pub const REFUSAL_STREAM_SILENCE: Duration = Duration::from_secs(30);

/// The longest line a refusal stream may send.
const MAX_REFUSAL_LINE: usize = 64 * 1024;

/// An open refusal stream.
pub struct RefusalStream {
    body: hyper::body::Incoming,
    buffer: Vec<u8>,
}

impl RefusalStream {
    pub(crate) fn new(body: hyper::body::Incoming) -> Self {
        Self { body, buffer: Vec::new() }
    }

    /// The next event; `Ok(None)` when the server ended the stream. An error when the connection broke, or stayed
    /// silent for [`REFUSAL_STREAM_SILENCE`].
    pub async fn next(&mut self) -> Result<Option<RefusalEvent>, ClientError> {
        loop {
            if let Some(end) = self.buffer.iter().position(|byte| *byte == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                let line = &line[..end];
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let parsed: RefusalLine = serde_json::from_slice(line)
                    .map_err(|error| ClientError::Decode(format!("a refusal stream line: {error}")))?;
                match parsed {
                    RefusalLine::Refusal { target, proxies, until } => {
                        let proxies = proxies
                            .iter()
                            .map(|proxy| proxy.parse::<ProxyId>())
                            .collect::<Result<Vec<_>, _>>()
                            .map_err(|error| ClientError::Decode(format!("a refused proxy: {error}")))?;
                        return Ok(Some(RefusalEvent::Refused { target, proxies, until }));
                    }
                    RefusalLine::Synced => return Ok(Some(RefusalEvent::Synced)),
                    RefusalLine::Heartbeat => continue,
                }
            }
            if self.buffer.len() > MAX_REFUSAL_LINE {
                return Err(ClientError::Decode(format!("a refusal stream line longer than {MAX_REFUSAL_LINE} bytes")));
            }
            let frame = match tokio::time::timeout(REFUSAL_STREAM_SILENCE, self.body.frame()).await {
                Err(_) => {
                    return Err(ClientError::Transport(format!(
                        "the refusal stream sent nothing for {}s",
                        REFUSAL_STREAM_SILENCE.as_secs()
                    )));
                }
                Ok(None) => return Ok(None),
                Ok(Some(frame)) => frame.map_err(|error| transport(&error))?,
            };
            if let Ok(data) = frame.into_data() {
                self.buffer.extend_from_slice(&data);
            }
        }
    }
}
