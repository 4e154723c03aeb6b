//! The image cache in each host's storage pool.
//!
//! An image is downloaded by the operator and streamed into the pool as `egress-image-<key>-<sha256 prefix>`
//! (libvirt's volume upload), hashed on the way; a mismatch aborts the upload and deletes the volume, so no partial
//! base is left. A marker volume (`….done`) written after a verified upload says the base is complete: a base
//! without its marker is re-fetched, unless guests already use it (then it is re-verified by reading it back, and
//! refused if it does not match). The checksum is part of the name, so a changed checksum is a new base and a base
//! in use is never replaced.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use egress_provider::ProviderError;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;
use virt::stream::Stream;

use crate::config::KvmImage;
use crate::conn::Host;
use crate::{classify, names, xml};

/// Chunks in flight between the download and the upload.
const CHANNEL_DEPTH: usize = 16;
/// Buffer for reading a volume back.
const READ_BUFFER: usize = 256 * 1024;

/// Downloads images into host pools, once per host, key and checksum at a time.
pub struct ImageCache {
    http: reqwest::Client,
    locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Background downloads started by [`ImageCache::ready_or_start`], by `<host>/<base volume>`.
    jobs: std::sync::Mutex<HashMap<String, Job>>,
}

/// A background download.
enum Job {
    Running {
        started: Instant,
        received: Arc<AtomicU64>,
    },
    /// Its error, handed to the next caller (who may start it again).
    Failed(ProviderError),
}

/// Whether an image can be used on a host yet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// The verified base volume's path.
    Ready(String),
    /// Being downloaded in the background.
    Downloading {
        /// Bytes received so far.
        received: u64,
        /// Seconds since the download started.
        seconds: u64,
    },
}

/// What the pool holds for one image.
struct Cached {
    base_path: Option<String>,
    marked: bool,
    in_use: bool,
}

impl ImageCache {
    /// A cache downloading with `http`.
    pub fn new(http: reqwest::Client) -> Self {
        Self { http, locks: std::sync::Mutex::default(), jobs: std::sync::Mutex::default() }
    }

    /// The base volume's path when the image is cached on `host`; otherwise starts (or reports on) a background
    /// download, so a create never waits minutes for one. A failed download's error is returned once, to the
    /// next caller, and the call after that starts over.
    pub async fn ready_or_start(
        self: &Arc<Self>,
        host: &Arc<Host>,
        key: &str,
        image: &KvmImage,
    ) -> Result<Readiness, ProviderError> {
        let base = names::base_volume(key, &image.sha256);
        let job_key = format!("{}/{base}", host.name);
        // Taken out in a statement of its own: the guard must be gone before the arms lock again.
        let job = self.jobs.lock().expect("image jobs").remove(&job_key);
        match job {
            Some(Job::Failed(error)) => return Err(error),
            Some(Job::Running { started, received }) => {
                let progress = Readiness::Downloading {
                    received: received.load(Ordering::Relaxed),
                    seconds: started.elapsed().as_secs(),
                };
                self.jobs.lock().expect("image jobs").insert(job_key, Job::Running { started, received });
                return Ok(progress);
            }
            None => {}
        }
        let cached = inspect(host, &base, &names::marker_volume(key, &image.sha256)).await?;
        if let Cached { base_path: Some(path), marked: true, .. } = cached {
            return Ok(Readiness::Ready(path));
        }
        let received = Arc::new(AtomicU64::new(0));
        let mut jobs = self.jobs.lock().expect("image jobs");
        if jobs.contains_key(&job_key) {
            // Another caller started it while this one looked at the pool.
            return Ok(Readiness::Downloading { received: 0, seconds: 0 });
        }
        jobs.insert(job_key.clone(), Job::Running { started: Instant::now(), received: received.clone() });
        drop(jobs);
        let (cache, host, key, image) = (self.clone(), host.clone(), key.to_owned(), image.clone());
        tokio::spawn(async move {
            let outcome = cache.ensure_counting(&host, &key, &image, &received).await;
            let mut jobs = cache.jobs.lock().expect("image jobs");
            match outcome {
                Ok(_) => {
                    jobs.remove(&job_key);
                }
                Err(error) => {
                    tracing::warn!(host = %host.name, image = %key, error = %error.chain(), "an image download failed");
                    jobs.insert(job_key, Job::Failed(error));
                }
            }
        });
        Ok(Readiness::Downloading { received: 0, seconds: 0 })
    }

    /// The path of the verified base volume for image `key` on `host`, downloading it first when needed.
    pub async fn ensure(&self, host: &Arc<Host>, key: &str, image: &KvmImage) -> Result<String, ProviderError> {
        self.ensure_counting(host, key, image, &AtomicU64::new(0)).await
    }

    /// [`ImageCache::ensure`], counting the bytes received in `received`.
    async fn ensure_counting(
        &self,
        host: &Arc<Host>,
        key: &str,
        image: &KvmImage,
        received: &AtomicU64,
    ) -> Result<String, ProviderError> {
        let base = names::base_volume(key, &image.sha256);
        let lock = {
            let mut locks = self.locks.lock().expect("image locks");
            locks.entry(format!("{}/{base}", host.name)).or_default().clone()
        };
        let _guard = lock.lock().await;

        let cached = inspect(host, &base, &names::marker_volume(key, &image.sha256)).await?;
        match cached {
            Cached { base_path: Some(path), marked: true, .. } => return Ok(path),
            Cached { base_path: Some(path), marked: false, in_use: true } => {
                // Guests use it: never replace it. Re-verify what is there and restore the marker if it matches.
                let actual = read_back_sha256(host, &base).await?;
                if actual != image.sha256 {
                    return Err(ProviderError::permanent(format!(
                        "base image {base} on host {} is in use but its marker is missing and its content has sha256 \
                         {actual}, not {}: remove the guests that use it, or restore the image",
                        host.name, image.sha256
                    )));
                }
                create_marker(host, key, image).await?;
                return Ok(path);
            }
            Cached { base_path: Some(_), marked: false, in_use: false } => {
                // An interrupted download: start again.
                delete_volume(host, &base).await?;
            }
            Cached { base_path: None, .. } => {}
        }
        let path = self.download(host, &base, image, received).await?;
        create_marker(host, key, image).await?;
        Ok(path)
    }

    /// Streams `image` into a new volume `base`, verifying its checksum; on any failure the volume is deleted.
    async fn download(
        &self,
        host: &Arc<Host>,
        base: &str,
        image: &KvmImage,
        received: &AtomicU64,
    ) -> Result<String, ProviderError> {
        let shown = shown_url(&image.url);
        tracing::info!(host = %host.name, volume = base, url = %shown, "downloading an image into the pool");
        let response = self.http.get(&image.url).send().await.map_err(|error| {
            let error = error.without_url();
            ProviderError::transient(format!("downloading {shown}: {error}")).with_source(error)
        })?;
        let status = response.status();
        if !status.is_success() {
            let message = format!("downloading {shown}: the server answered {status}");
            return Err(if status.is_client_error() {
                ProviderError::permanent(message)
            } else {
                ProviderError::transient(message)
            });
        }
        let capacity = response.content_length().unwrap_or(0);

        // A connection of its own: an upload can take minutes and must not hold up the host's other calls.
        let live = host.dial().await?;
        let (sender, mut receiver) = mpsc::channel::<Vec<u8>>(CHANNEL_DEPTH);
        let (pool, name, expected, host_name) =
            (host.pool.clone(), base.to_owned(), image.sha256.clone(), host.name.clone());
        let upload = tokio::task::spawn_blocking(move || -> Result<String, ProviderError> {
            let conn = live.connect();
            let fail = |error: virt::error::Error, op: &str| classify::classify(&error, op, &host_name, &name);
            let pool = StoragePool::lookup_by_name(conn, &pool).map_err(|error| fail(error, "storagePoolLookup"))?;
            let volume = StorageVol::create_xml(&pool, &xml::volume(&name, capacity, "raw", None), 0)
                .map_err(|error| fail(error, "storageVolCreate"))?;
            let outcome = (|| -> Result<String, ProviderError> {
                let path = volume.get_path().map_err(|error| fail(error, "storageVolGetPath"))?;
                let stream = Stream::new(conn, 0).map_err(|error| fail(error, "streamNew"))?;
                volume.upload(&stream, 0, 0, 0).map_err(|error| fail(error, "storageVolUpload"))?;
                let mut digest = Sha256::new();
                while let Some(chunk) = receiver.blocking_recv() {
                    digest.update(&chunk);
                    if let Err(error) = send_all(&stream, &chunk) {
                        let _ = stream.abort();
                        return Err(fail(error, "streamSend"));
                    }
                }
                let actual = hex(&digest.finalize());
                if actual != expected {
                    let _ = stream.abort();
                    return Err(ProviderError::permanent(format!(
                        "the image for volume {name} has sha256 {actual}, not the configured {expected}"
                    )));
                }
                stream.finish().map_err(|error| fail(error, "streamFinish"))?;
                Ok(path)
            })();
            if outcome.is_err() {
                let _ = volume.delete(0);
            }
            outcome
        });

        let mut response = response;
        let mut download_error = None;
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    received.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                    if sender.send(chunk.to_vec()).await.is_err() {
                        break; // the upload failed; its error is reported below
                    }
                }
                Ok(None) => break,
                Err(error) => {
                    let error = error.without_url();
                    download_error =
                        Some(ProviderError::transient(format!("downloading {shown}: {error}")).with_source(error));
                    break;
                }
            }
        }
        // After a failed download the closed channel looks like a complete image with the wrong checksum: the
        // upload still deletes its volume, and the download's error is the one reported.
        drop(sender);
        let uploaded = upload.await.map_err(|join| {
            ProviderError::transient(format!("uploading {base} to host {} panicked", host.name)).with_source(join)
        })?;
        if let Some(error) = download_error {
            return Err(error);
        }
        uploaded
    }
}

/// What the pool holds for a base volume and its marker, and whether any volume is backed by the base.
async fn inspect(host: &Arc<Host>, base: &str, marker: &str) -> Result<Cached, ProviderError> {
    let (pool, base, marker) = (host.pool.clone(), base.to_owned(), marker.to_owned());
    let ids = base.clone();
    host.call("imageInspect", &ids, move |conn| {
        let pool = StoragePool::lookup_by_name(conn, &pool)?;
        pool.refresh(0)?;
        let base_path = match StorageVol::lookup_by_name(&pool, &base) {
            Ok(volume) => Some(volume.get_path()?),
            Err(error) if error.code() == virt::error::ErrorNumber::NoStorageVolume => None,
            Err(error) => return Err(error),
        };
        let marked = StorageVol::lookup_by_name(&pool, &marker).is_ok();
        let mut in_use = false;
        if let Some(path) = &base_path {
            for volume in pool.list_all_volumes(0)? {
                if let Ok(description) = volume.get_xml_desc(0)
                    && backing_path(&description).as_deref() == Some(path.as_str())
                {
                    in_use = true;
                    break;
                }
            }
        }
        Ok(Cached { base_path, marked, in_use })
    })
    .await
}

/// The backing file of a volume's XML, if it has one.
pub fn backing_path(volume_xml: &str) -> Option<String> {
    let document = roxmltree::Document::parse(volume_xml).ok()?;
    let backing = document.descendants().find(|node| node.has_tag_name("backingStore"))?;
    let path = backing.children().find(|node| node.has_tag_name("path"))?;
    path.text().map(str::to_owned)
}

async fn create_marker(host: &Arc<Host>, key: &str, image: &KvmImage) -> Result<(), ProviderError> {
    let (pool, marker) = (host.pool.clone(), names::marker_volume(key, &image.sha256));
    let ids = marker.clone();
    host.call("storageVolCreate", &ids, move |conn| {
        let pool = StoragePool::lookup_by_name(conn, &pool)?;
        match StorageVol::create_xml(&pool, &xml::volume(&marker, 0, "raw", None), 0) {
            Ok(_) => Ok(()),
            Err(error) if error.code() == virt::error::ErrorNumber::StorageVolExist => Ok(()),
            Err(error) => Err(error),
        }
    })
    .await
}

/// Deletes the base images (and their markers) in the host's pool that are an older checksum of a configured image
/// key and that no volume is backed by: what a changed checksum leaves behind. `configured` holds the current base
/// volume name of each configured key. Bases of keys this provider does not configure are left alone: another
/// provider may share the pool. Returns the names of the bases removed.
pub async fn collect_unused(host: &Arc<Host>, configured: Vec<String>) -> Result<Vec<String>, ProviderError> {
    let pool = host.pool.clone();
    host.call("imageCollect", "", move |conn| {
        let pool = StoragePool::lookup_by_name(conn, &pool)?;
        let volumes = pool.list_all_volumes(0)?;
        let mut backing = Vec::new();
        let mut bases = Vec::new();
        for volume in &volumes {
            let name = volume.get_name()?;
            if let Some(path) = volume.get_xml_desc(0).ok().and_then(|description| backing_path(&description)) {
                backing.push(path);
            }
            if name.starts_with(names::BASE_PREFIX) && !name.ends_with(names::MARKER_SUFFIX) {
                bases.push((name, volume.get_path()?));
            }
        }
        let mut removed = Vec::new();
        // `egress-image-<key>-<16 hex>`: the same key with another checksum is an older version.
        let key_of = |name: &str| name.rsplit_once('-').map(|(key, _)| key.to_owned());
        let keys: Vec<String> = configured.iter().filter_map(|name| key_of(name)).collect();
        for (name, path) in bases {
            let outdated = key_of(&name).is_some_and(|key| keys.contains(&key)) && !configured.contains(&name);
            if !outdated || backing.contains(&path) {
                continue;
            }
            if let Ok(marker) = StorageVol::lookup_by_name(&pool, &format!("{name}{}", names::MARKER_SUFFIX)) {
                marker.delete(0)?;
            }
            StorageVol::lookup_by_name(&pool, &name)?.delete(0)?;
            removed.push(name);
        }
        Ok(removed)
    })
    .await
}

/// Deletes a volume of the host's pool; a missing one is fine.
pub async fn delete_volume(host: &Arc<Host>, name: &str) -> Result<(), ProviderError> {
    let (pool, name) = (host.pool.clone(), name.to_owned());
    let ids = name.clone();
    host.call("storageVolDelete", &ids, move |conn| {
        let pool = StoragePool::lookup_by_name(conn, &pool)?;
        match StorageVol::lookup_by_name(&pool, &name) {
            Ok(volume) => volume.delete(0),
            Err(error) if error.code() == virt::error::ErrorNumber::NoStorageVolume => Ok(()),
            Err(error) => Err(error),
        }
    })
    .await
}

/// Creates the qcow2 overlay `name` of `capacity` bytes on the base image at `base_path` (of `base_format`), or
/// returns the path of the one that exists.
pub async fn create_overlay(
    host: &Arc<Host>,
    name: &str,
    base_path: &str,
    base_format: &str,
    capacity: u64,
) -> Result<String, ProviderError> {
    let (pool, name, base_path, base_format) =
        (host.pool.clone(), name.to_owned(), base_path.to_owned(), base_format.to_owned());
    let ids = name.clone();
    host.call("storageVolCreate", &ids, move |conn| {
        let pool = StoragePool::lookup_by_name(conn, &pool)?;
        if let Ok(existing) = StorageVol::lookup_by_name(&pool, &name) {
            return existing.get_path();
        }
        let volume = xml::volume(&name, capacity, "qcow2", Some((&base_path, &base_format)));
        StorageVol::create_xml(&pool, &volume, 0)?.get_path()
    })
    .await
}

/// Creates volume `name` (raw) holding `data`, replacing one of that name: for small files such as seeds.
pub async fn put_volume(host: &Arc<Host>, name: &str, data: Vec<u8>) -> Result<String, ProviderError> {
    let (pool, name, test_driver) = (host.pool.clone(), name.to_owned(), host.is_test_driver());
    let ids = name.clone();
    host.call("storageVolUpload", &ids, move |conn| {
        let pool = StoragePool::lookup_by_name(conn, &pool)?;
        if let Ok(existing) = StorageVol::lookup_by_name(&pool, &name) {
            existing.delete(0)?;
        }
        let volume = StorageVol::create_xml(&pool, &xml::volume(&name, data.len() as u64, "raw", None), 0)?;
        // libvirt's test driver keeps no volume contents and cannot upload: there the volume stays empty.
        if test_driver {
            return volume.get_path();
        }
        let written = (|| {
            let stream = Stream::new(conn, 0)?;
            volume.upload(&stream, 0, data.len() as u64, 0)?;
            if let Err(error) = send_all(&stream, &data) {
                let _ = stream.abort();
                return Err(error);
            }
            stream.finish()?;
            volume.get_path()
        })();
        if written.is_err() {
            let _ = volume.delete(0);
        }
        written
    })
    .await
}

/// The sha256 of a volume's content, read back through a download stream on a connection of its own.
async fn read_back_sha256(host: &Arc<Host>, name: &str) -> Result<String, ProviderError> {
    let live = host.dial().await?;
    let (pool, name, host_name) = (host.pool.clone(), name.to_owned(), host.name.clone());
    tokio::task::spawn_blocking(move || {
        let conn = live.connect();
        let fail = |error: virt::error::Error, op: &str| classify::classify(&error, op, &host_name, &name);
        let pool = StoragePool::lookup_by_name(conn, &pool).map_err(|error| fail(error, "storagePoolLookup"))?;
        let volume = StorageVol::lookup_by_name(&pool, &name).map_err(|error| fail(error, "storageVolLookup"))?;
        let stream = Stream::new(conn, 0).map_err(|error| fail(error, "streamNew"))?;
        volume.download(&stream, 0, 0, 0).map_err(|error| fail(error, "storageVolDownload"))?;
        let mut digest = Sha256::new();
        let mut buffer = vec![0u8; READ_BUFFER];
        loop {
            let read = stream.recv(&mut buffer).map_err(|error| fail(error, "streamRecv"))?;
            if read == 0 {
                break;
            }
            digest.update(&buffer[..read]);
        }
        stream.finish().map_err(|error| fail(error, "streamFinish"))?;
        Ok(hex(&digest.finalize()))
    })
    .await
    .map_err(|join| ProviderError::transient("reading a volume back panicked").with_source(join))?
}

/// An image URL as logs and errors show it: without user info, query or fragment, which may carry credentials
/// (basic auth, a signed URL's signature).
pub fn shown_url(url: &str) -> String {
    match reqwest::Url::parse(url) {
        Ok(mut parsed) => {
            let _ = parsed.set_username("");
            let _ = parsed.set_password(None);
            parsed.set_query(None);
            parsed.set_fragment(None);
            parsed.to_string()
        }
        Err(_) => "<an unparsable URL>".to_owned(),
    }
}

fn send_all(stream: &Stream, mut data: &[u8]) -> Result<(), virt::error::Error> {
    while !data.is_empty() {
        let sent = stream.send(data)?;
        data = &data[sent..];
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_urls_are_shown_without_credentials() {
        assert_eq!(
            shown_url("https://user:pa55@images.example/d.qcow2?X-Amz-Signature=abc#x"),
            "https://images.example/d.qcow2"
        );
        assert_eq!(shown_url("http://127.0.0.1:9/plain.img"), "http://127.0.0.1:9/plain.img");
        assert_eq!(shown_url("not a url"), "<an unparsable URL>");
    }

    #[test]
    fn the_backing_path_is_read_from_volume_xml() {
        let overlay = xml::volume("px-a.qcow2", 1 << 30, "qcow2", Some(("/pool/egress-image-d-0123", "qcow2")));
        assert_eq!(backing_path(&overlay).as_deref(), Some("/pool/egress-image-d-0123"));
        assert_eq!(backing_path(&xml::volume("seed", 2048, "raw", None)), None);
    }
}
