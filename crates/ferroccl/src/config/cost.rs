//! The network model collectives are chosen by ([`CostModel`]) and where a
//! communicator's comes from ([`CostModelSpec`]).

use super::Tuning;
use crate::error::{Error, Result};

/// A network model: time of a message of `S` bytes is `alpha + S / bandwidth`, and
/// combining `S` bytes takes `S / reduce` ([`Tuning::cost_model`]; `ferroccl simulate`
/// plays the algorithms' plans on the same model).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct CostModel {
    /// Seconds per message.
    pub alpha: f64,
    /// Bytes per second of a rank's link.
    pub bandwidth: f64,
    /// Bytes per second a rank combines.
    pub reduce: f64,
    /// `(alpha, bandwidth)` of links between ranks of one host, when they differ from
    /// the links between hosts ([`CostModel::within_host`]); `None`: the same. What
    /// the hierarchical all-reduce's prediction uses within hosts.
    pub within_host: Option<(f64, f64)>,
}

impl CostModel {
    /// A model of `alpha` seconds per message, links of `bandwidth` bytes/s, combining
    /// at `reduce` bytes/s; each must be finite, `alpha >= 0` and the rates > 0.
    pub fn new(alpha: f64, bandwidth: f64, reduce: f64) -> Result<Self> {
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(Error::Config(format!(
                "cost model: alpha {alpha} s is not >= 0"
            )));
        }
        for (what, v) in [("bandwidth", bandwidth), ("reduce", reduce)] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::Config(format!(
                    "cost model: {what} {v} B/s is not > 0"
                )));
            }
        }
        Ok(Self {
            alpha,
            bandwidth,
            reduce,
            within_host: None,
        })
    }

    /// This model with links of `alpha` seconds and `bandwidth` bytes/s between ranks
    /// of one host (shared memory, say).
    pub fn within_host(mut self, alpha: f64, bandwidth: f64) -> Result<Self> {
        let m = Self::new(alpha, bandwidth, self.reduce)?;
        self.within_host = Some((m.alpha, m.bandwidth));
        Ok(self)
    }
}

impl std::fmt::Display for CostModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "alpha {:.3} us, link {:.3} GB/s, reduce {:.3} GB/s",
            self.alpha * 1e6,
            self.bandwidth / 1e9,
            self.reduce / 1e9
        )
    }
}

impl std::str::FromStr for CostModel {
    type Err = Error;
    /// `alpha_us=20,link_gbs=12.5,reduce_gbs=10`: α in microseconds, link and
    /// reduction rates in GB/s (10⁹ bytes per second); optionally the links within a
    /// host, `host_alpha_us=1,host_link_gbs=5` (both). Every key once, nothing else.
    fn from_str(s: &str) -> Result<Self> {
        let (mut a, mut l, mut r) = (None, None, None);
        let (mut ha, mut hl) = (None, None);
        let form = "alpha_us=20,link_gbs=12.5,reduce_gbs=10";
        for part in s.split(',') {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                Error::Config(format!(
                    "cost model '{s}': '{part}' is not key=value (e.g. {form})"
                ))
            })?;
            let v: f64 = v.trim().parse().map_err(|_| {
                Error::Config(format!("cost model '{s}': '{}' is not a number", v.trim()))
            })?;
            let slot = match k.trim() {
                "alpha_us" => &mut a,
                "link_gbs" => &mut l,
                "reduce_gbs" => &mut r,
                "host_alpha_us" => &mut ha,
                "host_link_gbs" => &mut hl,
                other => {
                    return Err(Error::Config(format!(
                        "cost model '{s}': unknown key '{other}' (e.g. {form})"
                    )))
                }
            };
            if slot.replace(v).is_some() {
                return Err(Error::Config(format!(
                    "cost model '{s}': '{}' given twice",
                    k.trim()
                )));
            }
        }
        let m = match (a, l, r) {
            (Some(a), Some(l), Some(r)) => CostModel::new(a * 1e-6, l * 1e9, r * 1e9)?,
            _ => {
                return Err(Error::Config(format!(
                    "cost model '{s}': needs alpha_us, link_gbs and reduce_gbs (e.g. {form})"
                )))
            }
        };
        match (ha, hl) {
            (None, None) => Ok(m),
            (Some(a), Some(l)) => m.within_host(a * 1e-6, l * 1e9),
            _ => Err(Error::Config(format!(
                "cost model '{s}': host_alpha_us and host_link_gbs go together"
            ))),
        }
    }
}

impl CostModel {
    /// The model in a `ferroccl bench --law RATE --json FILE` file: its `fit` object's
    /// `alpha_s`, `beta_s_per_byte` and `reduce_bytes_per_s` (the bench's own CPU
    /// reduction rate, f32 sum). `what` names the file in errors.
    pub fn from_law_json(text: &str, what: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("cost model {what}: not JSON ({e})")))?;
        let fit = v.get("fit").filter(|f| f.is_object()).ok_or_else(|| {
            Error::Config(format!(
                "cost model {what}: no \"fit\" object (write it with `ferroccl bench --law RATE --json FILE` over several sizes)"
            ))
        })?;
        let num = |k: &str| {
            fit.get(k).and_then(|x| x.as_f64()).ok_or_else(|| {
                Error::Config(format!(
                    "cost model {what}: fit has no number \"{k}\"{}",
                    if k == "reduce_bytes_per_s" {
                        " (an older bench wrote it: run `ferroccl bench --law` again)"
                    } else {
                        ""
                    }
                ))
            })
        };
        let (alpha, beta, reduce) = (
            num("alpha_s")?,
            num("beta_s_per_byte")?,
            num("reduce_bytes_per_s")?,
        );
        if !(beta.is_finite() && beta > 0.0) {
            return Err(Error::Config(format!(
                "cost model {what}: beta_s_per_byte {beta} is not > 0"
            )));
        }
        CostModel::new(alpha, 1.0 / beta, reduce).map_err(|e| Error::Config(format!("{what}: {e}")))
    }
}

/// Where [`Tuning::cost_model`] comes from: what `FERROCCL_COST_MODEL` and
/// `ferroccl bench --cost-model` say.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum CostModelSpec {
    /// This model.
    Given(CostModel),
    /// Measured on the communicator's own links when it is made
    /// ([`Tuning::measure_cost_model`]).
    Measure,
}

impl CostModelSpec {
    /// `measure`; `@FILE`, a `ferroccl bench --law RATE --json FILE` file (read now,
    /// see [`CostModel::from_law_json`]); or `alpha_us=20,link_gbs=12.5,reduce_gbs=10`.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "measure" {
            Ok(CostModelSpec::Measure)
        } else if let Some(path) = s.strip_prefix('@') {
            let text = std::fs::read_to_string(path)
                .map_err(|e| Error::Config(format!("cost model file {path}: {e}")))?;
            CostModel::from_law_json(&text, path).map(CostModelSpec::Given)
        } else {
            s.parse().map(CostModelSpec::Given)
        }
    }

    /// Sets `t` to it.
    pub fn apply(self, t: &mut Tuning) {
        match self {
            CostModelSpec::Given(m) => {
                t.cost_model = Some(m);
                t.measure_cost_model = false;
            }
            CostModelSpec::Measure => {
                t.cost_model = None;
                t.measure_cost_model = true;
            }
        }
    }
}
