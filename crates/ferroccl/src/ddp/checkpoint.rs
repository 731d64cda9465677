//! Checkpoints: a framework-independent file of named f32 tensors plus the run's
//! state as JSON, written atomically and sealed with a SHA-256.
//!
//! Layout (little-endian):
//!
//! ```text
//! magic      8 bytes   "FCCKPT\0\x01" (format version 1)
//! header_len u64       length of the JSON header
//! header     JSON      {"state": {...}, "tensors": [{"name", "shape", "offset", "len"}]}
//! data       f32 × Σ len, each tensor at its element offset
//! sha256     32 bytes  over everything before it
//! ```
//!
//! [`save`] writes a temporary file beside the target, fsyncs it, renames it over the
//! target and fsyncs the directory: a crash leaves either the old file or the new one,
//! never a mixture. [`load`] checks the length, the digest, the header and every
//! tensor's bounds before it hands anything back; a bad file is an
//! [`TrainError::Checkpoint`] that says what is wrong, and nothing is changed.
//!
//! [`CheckpointDir`] keeps the last few checkpoints of a run as `ckpt-<step>.fcc`, so a
//! checkpoint damaged after it was written still leaves an older good one.

use super::error::{TrainError, TrainResult as Result};
use crate::error::Error;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"FCCKPT\0\x01";
const DIGEST: usize = 32;
/// Refuse headers larger than this before allocating for them.
const MAX_HEADER: u64 = 64 << 20;

/// One named tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Its name (unique within a checkpoint).
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its elements, row-major.
    pub data: Vec<f32>,
}

/// A checkpoint's contents: tensors and the run's state (any JSON value).
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// The trainer's state: step, epoch, sampler position, RNG, optimizer scalars...
    pub state: serde_json::Value,
    /// Model parameters and optimizer buffers.
    pub tensors: Vec<Tensor>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    name: String,
    shape: Vec<usize>,
    offset: u64,
    len: u64,
}

#[derive(Serialize, Deserialize)]
struct Header {
    state: serde_json::Value,
    tensors: Vec<Entry>,
}

impl Checkpoint {
    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of the file (see the module docs).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut entries = Vec::with_capacity(self.tensors.len());
        let mut offset = 0u64;
        for t in &self.tensors {
            let n: usize = t.shape.iter().product();
            if n != t.data.len() {
                return Err(Error::InvalidArgument(format!(
                    "checkpoint tensor {:?}: shape {:?} holds {n} elements, data has {}",
                    t.name,
                    t.shape,
                    t.data.len()
                ))
                .into());
            }
            entries.push(Entry {
                name: t.name.clone(),
                shape: t.shape.clone(),
                offset,
                len: n as u64,
            });
            offset += n as u64;
        }
        let header = serde_json::to_vec(&Header {
            state: self.state.clone(),
            tensors: entries,
        })
        .map_err(|e| Error::InvalidArgument(format!("checkpoint state: {e}")))?;
        let mut out = Vec::with_capacity(16 + header.len() + 4 * offset as usize + DIGEST);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(&header);
        for t in &self.tensors {
            for x in &t.data {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        let digest = Sha256::digest(&out);
        out.extend_from_slice(&digest);
        Ok(out)
    }

    /// Parses and verifies a file's bytes; `path` only names it in errors.
    pub fn from_bytes(path: &Path, b: &[u8]) -> Result<Self> {
        let bad = |why: String| TrainError::checkpoint(path, why);
        if b.len() < MAGIC.len() + 8 + DIGEST {
            return Err(bad(format!(
                "truncated: {} bytes, shorter than any checkpoint",
                b.len()
            )));
        }
        if &b[..8] != MAGIC {
            if b[..6] == MAGIC[..6] {
                return Err(bad(format!(
                    "format version {} (this build reads version {})",
                    b[7], MAGIC[7]
                )));
            }
            return Err(bad("not a ferroccl checkpoint (bad magic)".into()));
        }
        let (body, digest) = b.split_at(b.len() - DIGEST);
        if Sha256::digest(body).as_slice() != digest {
            return Err(bad(
                "checksum mismatch: the file is corrupt or truncated".into()
            ));
        }
        let hlen = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        let rest = (body.len() - 16) as u64;
        if hlen > MAX_HEADER || hlen > rest {
            return Err(bad(format!("header length {hlen} exceeds the file")));
        }
        let hend = 16 + hlen as usize;
        let header: Header = serde_json::from_slice(&body[16..hend])
            .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
        let data = &body[hend..];
        if data.len() % 4 != 0 {
            return Err(bad(format!(
                "data section of {} bytes is not whole f32s",
                data.len()
            )));
        }
        let elems = (data.len() / 4) as u64;
        let mut tensors = Vec::with_capacity(header.tensors.len());
        for e in header.tensors {
            let n = e
                .shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d as u64));
            let end = e.offset.checked_add(e.len);
            if n != Some(e.len) || end.is_none_or(|end| end > elems) {
                return Err(bad(format!(
                    "tensor {:?} (shape {:?}, {} elements at {}) does not fit the file",
                    e.name, e.shape, e.len, e.offset
                )));
            }
            let s = &data[4 * e.offset as usize..4 * (e.offset + e.len) as usize];
            let v = s
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            tensors.push(Tensor {
                name: e.name,
                shape: e.shape,
                data: v,
            });
        }
        Ok(Checkpoint {
            state: header.state,
            tensors,
        })
    }
}

/// Writes `ckpt` to `path` atomically (see the module docs).
pub fn save(path: &Path, ckpt: &Checkpoint) -> Result<()> {
    let bytes = ckpt.to_bytes()?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::InvalidArgument(format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let io = |what: &str, e| Error::io(format!("{what} {}", tmp.display()), e);
    let r = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(|e| io("creating", e))?;
        f.write_all(&bytes).map_err(|e| io("writing", e))?;
        f.sync_all().map_err(|e| io("syncing", e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| {
            Error::io(
                format!("renaming {} to {}", tmp.display(), path.display()),
                e,
            )
        })?;
        // The rename itself is durable only once the directory is synced.
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

/// Reads and verifies the checkpoint at `path`.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let b = std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    Checkpoint::from_bytes(path, &b)
}

/// A run's checkpoint directory: `ckpt-<step>.fcc` files, the newest `keep` kept.
#[derive(Clone, Debug)]
pub struct CheckpointDir {
    dir: PathBuf,
    keep: usize,
}

impl CheckpointDir {
    /// The directory `dir` (created if missing), keeping the newest `keep` (≥ 1).
    pub fn new(dir: impl Into<PathBuf>, keep: usize) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        Ok(CheckpointDir {
            dir,
            keep: keep.max(1),
        })
    }

    /// The file of step `step`.
    pub fn path(&self, step: u64) -> PathBuf {
        self.dir.join(format!("ckpt-{step:010}.fcc"))
    }

    /// Checkpoint files, oldest first, with their steps.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>> {
        let rd = std::fs::read_dir(&self.dir)
            .map_err(|e| Error::io(format!("listing {}", self.dir.display()), e))?;
        let mut v: Vec<(u64, PathBuf)> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let step = name
                    .strip_prefix("ckpt-")?
                    .strip_suffix(".fcc")?
                    .parse()
                    .ok()?;
                Some((step, e.path()))
            })
            .collect();
        v.sort();
        Ok(v)
    }

    /// The newest checkpoint file, if any.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        Ok(self.list()?.pop().map(|(_, p)| p))
    }

    /// Saves step `step`'s checkpoint, then removes all but the newest `keep`.
    pub fn save(&self, step: u64, ckpt: &Checkpoint) -> Result<PathBuf> {
        let p = self.path(step);
        save(&p, ckpt)?;
        let all = self.list()?;
        for (_, old) in all.iter().take(all.len().saturating_sub(self.keep)) {
            let _ = std::fs::remove_file(old);
        }
        Ok(p)
    }

    /// Loads the newest checkpoint. If it is bad, the error names the older ones that
    /// are still on disk, so the user can choose one explicitly; nothing is deleted.
    pub fn load_latest(&self) -> Result<Option<(PathBuf, Checkpoint)>> {
        let all = self.list()?;
        let Some((_, newest)) = all.last() else {
            return Ok(None);
        };
        match load(newest) {
            Ok(c) => Ok(Some((newest.clone(), c))),
            Err(TrainError::Checkpoint { path, why }) if all.len() > 1 => {
                let older: Vec<String> = all[..all.len() - 1]
                    .iter()
                    .rev()
                    .map(|(_, p)| p.display().to_string())
                    .collect();
                Err(TrainError::Checkpoint {
                    path,
                    why: format!(
                        "{why}; older checkpoints are still there (newest first): {} — resume from one explicitly",
                        older.join(", ")
                    ),
                })
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            state: serde_json::json!({"step": 7, "epoch": 1}),
            tensors: vec![
                Tensor {
                    name: "w".into(),
                    shape: vec![2, 3],
                    data: vec![1.0, 2.0, 3.0, 4.0, 5.0, -6.5],
                },
                Tensor {
                    name: "b".into(),
                    shape: vec![0],
                    data: vec![],
                },
            ],
        }
    }

    #[test]
    fn round_trip() {
        let c = sample();
        let b = c.to_bytes().unwrap();
        assert_eq!(Checkpoint::from_bytes(Path::new("x"), &b).unwrap(), c);
    }

    #[test]
    fn every_single_byte_flip_and_every_truncation_is_refused() {
        let b = sample().to_bytes().unwrap();
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x10;
            let e = Checkpoint::from_bytes(Path::new("x"), &c).unwrap_err();
            assert!(matches!(e, TrainError::Checkpoint { .. }), "byte {i}: {e}");
        }
        for n in 0..b.len() {
            assert!(
                Checkpoint::from_bytes(Path::new("x"), &b[..n]).is_err(),
                "len {n}"
            );
        }
    }

    #[test]
    fn shape_mismatch_is_refused_on_save() {
        let mut c = sample();
        c.tensors[0].data.pop();
        assert!(c.to_bytes().is_err());
    }

    #[test]
    fn dir_keeps_the_newest_and_names_older_ones_when_the_newest_is_bad() {
        let d = std::env::temp_dir().join(format!("ferroccl-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let cd = CheckpointDir::new(&d, 2).unwrap();
        for step in [10, 20, 30] {
            cd.save(step, &sample()).unwrap();
        }
        let steps: Vec<u64> = cd.list().unwrap().iter().map(|(s, _)| *s).collect();
        assert_eq!(steps, vec![20, 30]);
        // Damage the newest: refused, the older one named and still loadable.
        let newest = cd.path(30);
        let mut b = std::fs::read(&newest).unwrap();
        let n = b.len();
        b.truncate(n - 5);
        std::fs::write(&newest, &b).unwrap();
        let e = cd.load_latest().unwrap_err().to_string();
        assert!(
            e.contains("checksum") && e.contains("ckpt-0000000020.fcc"),
            "{e}"
        );
        assert_eq!(load(&cd.path(20)).unwrap(), sample());
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 2);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
