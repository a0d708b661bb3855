//! The blob store on disk: files in `BLOB_DIR`, moved by the `relay-disk` thread so the event
//! loop never blocks on a file. Every path is built from a file id the server generated (a
//! UUID); no string a client supplies ever becomes part of a path. Each blob `<id>.blob` has its
//! metadata next to it in `<id>.json`; uploads are written to `.tmp-<id>` and renamed into
//! place when complete, so a crash leaves either a whole file or a temp file that the next
//! start removes.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;
use crate::log::Level;
use crate::tasks::uuid_string;

/// Starts the disk thread; `wake` is called after each answer is queued.
pub fn start(dir: PathBuf, wake: Arc<dyn Fn() + Send + Sync>) -> io::Result<Store> {
    let mut disk = Disk { dir, open: HashMap::new() };
    Store::spawn("relay-disk", move |job| disk.run(job), wake)
}

enum OpenFile {
    Upload { file: File, tmp: PathBuf, file_id: u128, failed: Option<String> },
    Download { file: File },
}

struct Disk {
    dir: PathBuf,
    open: HashMap<TransferId, OpenFile>,
}

/// BLOB_DIR and everything in it is relay's alone (other local users must not read uploads or
/// plant metadata).
const DIR_MODE: u32 = 0o700;
const FILE_MODE: u32 = 0o600;

/// Creates BLOB_DIR (mode 0700) or checks the one that exists: it must be a directory owned
/// by the user relay runs as; group and other permissions are removed. At startup, before the
/// loop runs; the error says what is wrong (relay then refuses to start).
pub fn prepare_blob_dir(dir: &Path) -> Result<(), String> {
    create_private_dir(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let meta = fs::metadata(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("{} is not a directory", dir.display()));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me {
        return Err(format!(
            "{} is owned by uid {}, not by this user (uid {me}): refusing to keep uploads there",
            dir.display(),
            meta.uid()
        ));
    }
    if meta.mode() & 0o077 != 0 {
        fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE))
            .map_err(|e| format!("cannot make {} private: {e}", dir.display()))?;
    }
    Ok(())
}

fn create_private_dir(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir)
}

/// A new file only relay may read (mode 0600), failing if it exists.
fn create_private_file(path: &Path) -> io::Result<File> {
    OpenOptions::new().write(true).create_new(true).mode(FILE_MODE).open(path)
}

impl FileMeta {
    /// Metadata read from disk becomes response headers: every field must be what relay
    /// itself would have written (a planted or damaged file must not inject a header).
    fn is_valid(&self, id: u128) -> bool {
        let header_safe = |s: &str| s.bytes().all(|b| (0x20..0x7f).contains(&b));
        self.file_id == uuid_string(id)
            && sanitize_content_type(Some(&self.content_type)) == self.content_type
            && header_safe(&self.content_type)
            && !self.filename.is_empty()
            && self.filename.len() <= 255
            && !self.filename.chars().any(|c| c.is_control() || matches!(c, '"' | '/' | '\\'))
            && self.sha256.len() == 64
            && self.sha256.bytes().all(|b| b.is_ascii_hexdigit())
    }
}

/// Metadata files are small; a larger one is not ours.
const MAX_META_BYTES: u64 = 64 * 1024;
/// A temp file or a blob without metadata is left over from a crash only once nothing has
/// written to it for this long; younger ones may belong to an upload under way (in this process
/// or in another relay sharing the directory).
const STALE_LEFTOVER_MS: u64 = 60 * 60 * 1000;

impl Disk {
    fn blob_path(&self, id: u128) -> PathBuf {
        self.dir.join(format!("{}.blob", uuid_string(id)))
    }
    fn meta_path(&self, id: u128) -> PathBuf {
        self.dir.join(format!("{}.json", uuid_string(id)))
    }

    fn run(&mut self, job: Job) -> Option<Done> {
        match job {
            Job::Scan { now_wall_ms } => Some(Done::Scanned(self.scan(now_wall_ms))),
            Job::Sweep { now_wall_ms } => {
                self.scan(now_wall_ms);
                None
            }
            Job::Create { t, file_id } => {
                let tmp = self.dir.join(format!(".tmp-{}", uuid_string(file_id)));
                let result = create_private_dir(&self.dir)
                    .and_then(|()| create_private_file(&tmp))
                    .map(|file| {
                        self.open.insert(t, OpenFile::Upload { file, tmp, file_id, failed: None });
                    })
                    .map_err(|e| e.to_string());
                Some(Done::Created { t, result })
            }
            Job::Write { t, data } => {
                let len = data.len();
                if let Some(OpenFile::Upload { file, failed, .. }) = self.open.get_mut(&t)
                    && failed.is_none()
                    && let Err(e) = file.write_all(&data)
                {
                    *failed = Some(e.to_string());
                }
                Some(Done::Written { t, len })
            }
            Job::Finish { t, meta } => Some(Done::Finished { t, result: self.finish(t, meta) }),
            Job::Abort { t } => {
                if let Some(OpenFile::Upload { tmp, .. }) = self.open.remove(&t) {
                    let _ = fs::remove_file(tmp);
                }
                None
            }
            Job::Open { t, file_id, now_wall_ms } => {
                let result = self.open_download(file_id, now_wall_ms).map(|(file, meta)| {
                    self.open.insert(t, OpenFile::Download { file });
                    meta
                });
                Some(Done::Opened { t, result })
            }
            Job::Read { t, offset, len } => {
                let result = match self.open.get(&t) {
                    Some(OpenFile::Download { file }) => read_at(file, offset, len).map_err(|e| e.to_string()),
                    _ => Err("no such download".to_string()),
                };
                Some(Done::Read { t, result })
            }
            Job::Close { t } => {
                self.open.remove(&t);
                None
            }
            Job::Delete { file_id } => {
                // Metadata first: without it the blob is unreachable and the next scan removes it.
                let _ = fs::remove_file(self.meta_path(file_id));
                let _ = fs::remove_file(self.blob_path(file_id));
                crate::log!(Level::Debug, "file expired", file_id = uuid_string(file_id));
                None
            }
        }
    }

    fn finish(&mut self, t: TransferId, meta: FileMeta) -> Result<FileMeta, String> {
        let Some(OpenFile::Upload { file, tmp, file_id, failed }) = self.open.remove(&t) else {
            return Err("no such upload".into());
        };
        let result = (|| {
            if let Some(e) = failed {
                return Err(e);
            }
            file.sync_all().map_err(|e| e.to_string())?;
            drop(file);
            fs::rename(&tmp, self.blob_path(file_id)).map_err(|e| e.to_string())?;
            let json = serde_json::to_vec(&meta).map_err(|e| e.to_string())?;
            let meta_tmp = self.dir.join(format!(".tmp-{}.json", uuid_string(file_id)));
            let mut f = create_private_file(&meta_tmp).map_err(|e| e.to_string())?;
            f.write_all(&json).and_then(|()| f.sync_all()).map_err(|e| e.to_string())?;
            fs::rename(&meta_tmp, self.meta_path(file_id)).map_err(|e| e.to_string())?;
            Ok(meta)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
            let _ = fs::remove_file(self.blob_path(file_id));
        }
        result
    }

    fn read_meta(&self, id: u128) -> Result<FileMeta, OpenError> {
        let path = self.meta_path(id);
        let file = File::open(&path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => OpenError::NotFound,
            _ => OpenError::Io(e.to_string()),
        })?;
        let mut text = Vec::new();
        file.take(MAX_META_BYTES).read_to_end(&mut text).map_err(|e| OpenError::Io(e.to_string()))?;
        let meta: FileMeta = serde_json::from_slice(&text).map_err(|_| OpenError::NotFound)?;
        if !meta.is_valid(id) {
            crate::log!(Level::Warn, "invalid file metadata ignored", file_id = uuid_string(id));
            return Err(OpenError::NotFound);
        }
        Ok(meta)
    }

    fn open_download(&self, id: u128, now_wall_ms: u64) -> Result<(File, FileMeta), OpenError> {
        let meta = self.read_meta(id)?;
        if meta.expires_ms <= now_wall_ms {
            return Err(OpenError::NotFound);
        }
        let file = File::open(self.blob_path(id)).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => OpenError::NotFound,
            _ => OpenError::Io(e.to_string()),
        })?;
        let len = file.metadata().map_err(|e| OpenError::Io(e.to_string()))?.len();
        if len != meta.size {
            return Err(OpenError::Io(format!("blob is {len} bytes, metadata says {}", meta.size)));
        }
        Ok((file, meta))
    }

    fn scan(&self, now_wall_ms: u64) -> Vec<(u128, u64)> {
        if let Err(e) = create_private_dir(&self.dir) {
            crate::log!(Level::Error, "cannot create BLOB_DIR", dir = self.dir.display(), error = e);
            return Vec::new();
        }
        let Ok(entries) = fs::read_dir(&self.dir) else { return Vec::new() };
        let mut live = Vec::new();
        let mut blobs = Vec::new();
        let mut removed = 0usize;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with(".tmp-") {
                if is_stale(&entry, now_wall_ms) {
                    let _ = fs::remove_file(entry.path());
                    removed += 1;
                }
            } else if let Some(id) = name.strip_suffix(".json").and_then(crate::tasks::parse_id) {
                match self.read_meta(id) {
                    Ok(meta) if meta.expires_ms > now_wall_ms && self.blob_path(id).exists() => {
                        live.push((id, meta.expires_ms))
                    }
                    _ => {
                        let _ = fs::remove_file(self.meta_path(id));
                        let _ = fs::remove_file(self.blob_path(id));
                        removed += 1;
                    }
                }
            } else if let Some(id) = name.strip_suffix(".blob").and_then(crate::tasks::parse_id)
                && is_stale(&entry, now_wall_ms)
            {
                blobs.push(id);
            }
        }
        for id in blobs {
            if !live.iter().any(|(l, _)| *l == id) && !self.meta_path(id).exists() {
                let _ = fs::remove_file(self.blob_path(id));
                removed += 1;
            }
        }
        crate::log!(Level::Info, "blob store ready", dir = self.dir.display(), files = live.len(), removed = removed);
        live
    }
}

/// Not modified for [`STALE_LEFTOVER_MS`].
fn is_stale(entry: &fs::DirEntry, now_wall_ms: u64) -> bool {
    let modified_ms = entry
        .metadata()
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    modified_ms + STALE_LEFTOVER_MS <= now_wall_ms
}

fn read_at(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

/// The path of a blob, for tests that look at the disk.
pub fn blob_path(dir: &Path, id: u128) -> PathBuf {
    dir.join(format!("{}.blob", uuid_string(id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_round_trip_and_scan() {
        let dir = std::env::temp_dir().join(format!("relay-files-unit-{}", uuid::Uuid::new_v4()));
        let mut disk = Disk { dir: dir.clone(), open: HashMap::new() };
        assert!(disk.scan(0).is_empty());
        let id = 0x1234_u128 << 64 | 0x4000_8000_0000_0001;
        assert!(matches!(disk.run(Job::Create { t: 1, file_id: id }), Some(Done::Created { result: Ok(()), .. })));
        disk.run(Job::Write { t: 1, data: b"hello ".to_vec() });
        disk.run(Job::Write { t: 1, data: b"world".to_vec() });
        let meta = FileMeta {
            file_id: uuid_string(id),
            filename: "h.txt".into(),
            content_type: "text/plain".into(),
            size: 11,
            sha256: "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824".into(),
            created_ms: 1,
            expires_ms: 1_000,
        };
        assert!(matches!(
            disk.run(Job::Finish { t: 1, meta: meta.clone() }),
            Some(Done::Finished { result: Ok(_), .. })
        ));
        assert!(matches!(
            disk.run(Job::Open { t: 2, file_id: id, now_wall_ms: 5 }),
            Some(Done::Opened { result: Ok(_), .. })
        ));
        match disk.run(Job::Read { t: 2, offset: 6, len: 100 }) {
            Some(Done::Read { result: Ok(data), .. }) => assert_eq!(data, b"world"),
            other => panic!("{other:?}"),
        }
        // Past its time it is gone for readers, and a scan removes it.
        assert!(matches!(
            disk.run(Job::Open { t: 3, file_id: id, now_wall_ms: 1_000 }),
            Some(Done::Opened { result: Err(OpenError::NotFound), .. })
        ));
        std::fs::write(dir.join(".tmp-stale"), b"x").expect("tmp");
        let now = crate::timefmt::wall_ms();
        // A fresh temp file may be an upload under way (here or in another relay): kept.
        assert!(disk.scan(5).iter().any(|(i, _)| *i == id));
        assert!(dir.join(".tmp-stale").exists());
        // An hour later nothing is writing it any more: removed, and so is the expired file.
        assert!(disk.scan(now + STALE_LEFTOVER_MS).is_empty(), "past its TTL");
        assert!(!dir.join(".tmp-stale").exists());
        assert!(!blob_path(&dir, id).exists());
        // A blob without metadata is an upload's last step, or a crash's leftover once old.
        let orphan = blob_path(&dir, 77);
        std::fs::write(&orphan, b"x").expect("orphan");
        // (Its mtime is a little after `now`: the clock is read again.)
        let now = crate::timefmt::wall_ms();
        disk.scan(now);
        assert!(orphan.exists());
        disk.scan(now + STALE_LEFTOVER_MS + 1_000);
        assert!(!orphan.exists());
        let _ = std::fs::remove_dir_all(dir);
    }
}
