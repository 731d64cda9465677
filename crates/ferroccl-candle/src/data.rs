//! Datasets of 28×28 grey-scale digits: the mnist_5k CSV (784 pixels then the label
//! per row, optionally gzipped), the standard MNIST IDX files, and a synthetic set
//! that needs no download.

use crate::error::{Error, Result};
use ferroccl::ddp::Rng;
use std::io::Read;
use std::path::Path;

/// Pixels per side.
pub const SIDE: usize = 28;
/// Pixels per image.
pub const PIXELS: usize = SIDE * SIDE;
/// Classes.
pub const CLASSES: usize = 10;

/// Images (pixels scaled to [0, 1], row-major, `PIXELS` per image) and their labels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dataset {
    /// `len() * PIXELS` values.
    pub images: Vec<f32>,
    /// Labels in `0..CLASSES`.
    pub labels: Vec<u8>,
}

impl Dataset {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when there are no images.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Image `i`'s pixels.
    pub fn image(&self, i: usize) -> &[f32] {
        &self.images[i * PIXELS..(i + 1) * PIXELS]
    }

    /// The images at `idx`, in that order.
    pub fn select(&self, idx: &[usize]) -> Dataset {
        let mut d = Dataset::default();
        self.select_into(idx, &mut d);
        d
    }

    /// [`Dataset::select`] into `out`, reusing its allocations.
    pub fn select_into(&self, idx: &[usize], out: &mut Dataset) {
        out.images.clear();
        out.labels.clear();
        for &i in idx {
            out.images.extend_from_slice(self.image(i));
            out.labels.push(self.labels[i]);
        }
    }

    /// Splits off a held-out test set of `test_fraction` of the images, chosen by a
    /// seeded shuffle (files such as mnist_5k are sorted by label).
    pub fn split(&self, test_fraction: f64, seed: u64) -> (Dataset, Dataset) {
        let mut idx: Vec<usize> = (0..self.len()).collect();
        Rng::derive(seed, 0x0053_504c_4954).shuffle(&mut idx);
        let n_test = ((self.len() as f64) * test_fraction.clamp(0.0, 1.0)).round() as usize;
        let (test, train) = idx.split_at(n_test);
        (self.select(train), self.select(test))
    }

    /// Loads a dataset from `path`: a directory holding the MNIST IDX files
    /// (`train-images-idx3-ubyte` and `train-labels-idx1-ubyte`, optionally `.gz`), or
    /// a CSV file (`.csv` or `.csv.gz`) of 784 pixel values then the label per row.
    pub fn load(path: &Path) -> Result<Dataset> {
        if path.is_dir() {
            let find = |stem: &str| -> Result<std::path::PathBuf> {
                for name in [stem.to_string(), format!("{stem}.gz")] {
                    let p = path.join(&name);
                    if p.exists() {
                        return Ok(p);
                    }
                }
                Err(Error::invalid(format!(
                    "{} has no {stem} (or {stem}.gz): expected the MNIST IDX files",
                    path.display()
                )))
            };
            let images = read_maybe_gz(&find("train-images-idx3-ubyte")?)?;
            let labels = read_maybe_gz(&find("train-labels-idx1-ubyte")?)?;
            return parse_idx(&images, &labels).map_err(|e| {
                Error::invalid(format!("MNIST IDX files in {}: {e}", path.display()))
            });
        }
        let text = read_maybe_gz(path)?;
        parse_csv(&text).map_err(|e| Error::invalid(format!("dataset {}: {e}", path.display())))
    }

    /// A synthetic digit-like dataset of `n` images: each class is a fixed random
    /// stroke pattern, each image its class's pattern shifted by up to 2 pixels with
    /// noise added. Easy (a LeNet reaches ~99% in two epochs): it exists so the
    /// command always runs; measure on real digits (mnist_5k, MNIST).
    pub fn synthetic(n: usize, seed: u64) -> Dataset {
        let mut rng = Rng::derive(seed, 0x5359_4e54);
        let templates: Vec<Vec<f32>> = (0..CLASSES)
            .map(|_| {
                let mut t = vec![0.0f32; PIXELS];
                // A few random strokes per class.
                for _ in 0..4 {
                    let (mut y, mut x) = (4 + rng.below(20) as i64, 4 + rng.below(20) as i64);
                    let (dy, dx) = (rng.below(3) as i64 - 1, rng.below(3) as i64 - 1);
                    for _ in 0..10 {
                        if (0..SIDE as i64).contains(&y) && (0..SIDE as i64).contains(&x) {
                            t[y as usize * SIDE + x as usize] = 1.0;
                        }
                        y += dy;
                        x += dx;
                    }
                }
                t
            })
            .collect();
        let mut d = Dataset {
            images: Vec::with_capacity(n * PIXELS),
            labels: Vec::with_capacity(n),
        };
        for i in 0..n {
            let c = i % CLASSES;
            let (sy, sx) = (rng.below(5) as i64 - 2, rng.below(5) as i64 - 2);
            for y in 0..SIDE as i64 {
                for x in 0..SIDE as i64 {
                    let (ty, tx) = (y - sy, x - sx);
                    let v = if (0..SIDE as i64).contains(&ty) && (0..SIDE as i64).contains(&tx) {
                        templates[c][ty as usize * SIDE + tx as usize]
                    } else {
                        0.0
                    };
                    d.images
                        .push((v + 0.8 * rng.next_f32() - 0.4).clamp(0.0, 1.0));
                }
            }
            d.labels.push(c as u8);
        }
        d
    }
}

fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let raw =
        std::fs::read(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::MultiGzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| Error::io(format!("decompressing {}", path.display()), e))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Parses CSV rows of 784 pixel values (0..=255) followed by a label (0..=9); what is
/// wrong as a sentence, which [`Dataset::load`] turns into the crate's error naming the
/// file.
pub(crate) fn parse_csv(text: &[u8]) -> std::result::Result<Dataset, String> {
    let text = std::str::from_utf8(text).map_err(|_| "not UTF-8 text".to_string())?;
    let mut d = Dataset::default();
    for (ln, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let start = d.images.len();
        let mut fields = 0;
        let mut label = 0u8;
        for f in line.split(',') {
            let v: f32 = f
                .trim()
                .parse()
                .map_err(|_| format!("line {}: {f:?} is not a number", ln + 1))?;
            if fields < PIXELS {
                if !(0.0..=255.0).contains(&v) {
                    return Err(format!("line {}: pixel value {v} outside 0..=255", ln + 1));
                }
                d.images.push(v / 255.0);
            } else if fields == PIXELS {
                if v.fract() != 0.0 || !(0.0..CLASSES as f32).contains(&v) {
                    return Err(format!("line {}: label {v} is not a digit 0..=9", ln + 1));
                }
                label = v as u8;
            }
            fields += 1;
        }
        if fields != PIXELS + 1 {
            d.images.truncate(start);
            return Err(format!(
                "line {}: {fields} values, expected {} (784 pixels then the label)",
                ln + 1,
                PIXELS + 1
            ));
        }
        d.labels.push(label);
    }
    if d.is_empty() {
        return Err("no rows".into());
    }
    Ok(d)
}

/// Parses the MNIST IDX image (magic 2051) and label (magic 2049) files.
pub(crate) fn parse_idx(images: &[u8], labels: &[u8]) -> std::result::Result<Dataset, String> {
    let be = |b: &[u8], at: usize| -> std::result::Result<usize, String> {
        b.get(at..at + 4)
            .map(|s| u32::from_be_bytes(s.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| "file shorter than its header".to_string())
    };
    if be(images, 0)? != 2051 {
        return Err("images file: bad magic (expected 2051)".into());
    }
    if be(labels, 0)? != 2049 {
        return Err("labels file: bad magic (expected 2049)".into());
    }
    let (n, rows, cols) = (be(images, 4)?, be(images, 8)?, be(images, 12)?);
    if rows != SIDE || cols != SIDE {
        return Err(format!("images are {rows}×{cols}, expected 28×28"));
    }
    if be(labels, 4)? != n {
        return Err(format!("{n} images but {} labels", be(labels, 4)?));
    }
    let px = images.get(16..16 + n * PIXELS).ok_or_else(|| {
        format!(
            "images file truncated: {n} images need {} bytes",
            16 + n * PIXELS
        )
    })?;
    let lb = labels
        .get(8..8 + n)
        .ok_or_else(|| format!("labels file truncated: {n} labels need {} bytes", 8 + n))?;
    if let Some(bad) = lb.iter().find(|&&l| l as usize >= CLASSES) {
        return Err(format!("label {bad} is not a digit 0..=9"));
    }
    Ok(Dataset {
        images: px.iter().map(|&p| p as f32 / 255.0).collect(),
        labels: lb.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_rows_parse_and_bad_rows_are_refused() {
        let mut row: Vec<String> = (0..PIXELS).map(|i| (i % 256).to_string()).collect();
        row.push("7".into());
        let text = format!("{}\n{}\n", row.join(","), row.join(","));
        let d = parse_csv(text.as_bytes()).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d.labels, vec![7, 7]);
        assert_eq!(d.image(1)[255], 1.0);
        let short = row[1..].join(",");
        assert!(parse_csv(short.as_bytes())
            .unwrap_err()
            .contains("784 pixels"));
        let mut bad = row.clone();
        bad[PIXELS] = "12".into();
        assert!(parse_csv(bad.join(",").as_bytes())
            .unwrap_err()
            .contains("label"));
    }

    #[test]
    fn idx_round_trip_and_truncation() {
        let n = 3;
        let mut img = vec![0, 0, 8, 3, 0, 0, 0, n as u8, 0, 0, 0, 28, 0, 0, 0, 28];
        img.extend((0..n * PIXELS).map(|i| (i % 256) as u8));
        let lab = vec![0, 0, 8, 1, 0, 0, 0, n as u8, 4, 5, 6];
        let d = parse_idx(&img, &lab).unwrap();
        assert_eq!(d.labels, vec![4, 5, 6]);
        assert_eq!(d.image(0)[1], 1.0 / 255.0);
        assert!(parse_idx(&img[..img.len() - 1], &lab)
            .unwrap_err()
            .contains("truncated"));
        assert!(parse_idx(&lab, &img).is_err());
    }

    #[test]
    fn synthetic_is_seeded_and_split_is_disjoint() {
        let a = Dataset::synthetic(100, 1);
        assert_eq!(a, Dataset::synthetic(100, 1));
        assert_ne!(a, Dataset::synthetic(100, 2));
        let (tr, te) = a.split(0.2, 9);
        assert_eq!((tr.len(), te.len()), (80, 20));
        assert!(a.images.iter().all(|p| (0.0..=1.0).contains(p)));
    }
}
