//! The launcher environment: who am I, how many are we, where is rank 0.
//!
//! The only place in the crate that reads launcher environment variables.

use crate::error::{Error, Result};

/// What the launcher told this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank among the processes on this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// How many of the job's processes run on this host, when the launcher says
    /// (`LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`,
    /// `SLURM_NTASKS_PER_NODE`).
    pub local_world_size: Option<usize>,
    /// `SLURM_CPUS_PER_TASK`, in a task srun started: the CPUs Slurm gave each task
    /// (`--cpus-per-task`), which [`LaunchEnv::compute_threads`] then takes.
    pub cpus_per_task: Option<usize>,
    /// `MASTER_ADDR`, when set.
    pub master_addr: Option<String>,
    /// `MASTER_PORT`, when set.
    pub master_port: Option<u16>,
    /// Which launcher the variables came from: `torchrun`, `openmpi`, `pmi`, `slurm`.
    pub source: &'static str,
    /// `FERROCCL_TOKEN`, the job token, when set (see `Job::token` in `crate::config`).
    pub token: Option<String>,
    /// `FERROCCL_RDMA_GID_INDEX`: the GID table index the RDMA transport routes with
    /// (RoCE v2 setups often need one other than 0; `show_gids` lists them).
    pub rdma_gid_index: Option<u8>,
    /// `FERROCCL_TRACE_CAPACITY`: operations the flight recorder keeps (0: none).
    pub trace_capacity: Option<usize>,
    /// `FERROCCL_BUSY_POLL_US`: how long, in microseconds, a wait polls before it
    /// sleeps (`Tuning::busy_poll` in `crate::config`).
    pub busy_poll_us: Option<u64>,
    /// The launcher's name for this job, the same on every rank of it and different
    /// for another job: `FERROCCL_JOB_ID` (`ferroccl launch`), torchrun's
    /// `TORCHELASTIC_RUN_ID` and restart count, Slurm's `SLURM_JOB_ID` and
    /// `SLURM_STEP_ID`, Open MPI's `PMIX_NAMESPACE` or `OMPI_MCA_ess_base_jobid`, PMI's
    /// `PMI_KVSNAME`. `None` when the launcher gives none.
    pub job_id: Option<String>,
    /// `FERROCCL_ALGO`: the all-reduce algorithm to force (parsed by the config).
    pub algo: Option<String>,
    /// `FERROCCL_COST_MODEL`: the network model that chooses it (parsed by the config).
    pub cost_model: Option<String>,
    /// `TORCHELASTIC_USE_AGENT_STORE` is true: `MASTER_ADDR:MASTER_PORT` is a PyTorch
    /// TCPStore that torchrun's agent serves, not a port for rank 0 to take.
    pub agent_store: bool,
    /// `FERROCCL_TRANSPORT`: the transport's name (`auto`, `tcp`, `shm`, ...), checked
    /// by `Config::from_env`.
    pub transport: Option<String>,
    /// `FERROCCL_TCP_CONGESTION`: the TCP links' congestion control (`auto`, `system`
    /// or a name), checked by `Config::from_env`.
    pub tcp_congestion: Option<String>,
    /// `FERROCCL_SHM_SINGLE_COPY`: the smallest frame the shared-memory transport
    /// moves in one copy (bytes, `64K`, or `off`), checked by `Config::from_env`.
    pub shm_single_copy: Option<String>,
    /// `FERROCCL_SHM_SYMMETRIC`: whether the shared-memory transport reads peers'
    /// memory when the whole job is on one host (`on`/`off`), checked by
    /// `Config::from_env`.
    pub shm_symmetric: Option<String>,
    /// `FERROCCL_CUDA_ORDER`: where CUDA IPC orders the ranks' steps (`host` or
    /// `device`), checked by `Config::from_env`.
    pub cuda_order: Option<String>,
    /// `FERROCCL_BIND`: whether each rank binds to its share of the host's CPUs
    /// (`on`/`off`), checked by `Config::from_env`.
    pub bind: Option<String>,
}

impl LaunchEnv {
    /// Threads this rank's own compute pool (candle's, rayon's) should have: the CPUs
    /// Slurm gave the task ([`cpus_per_task`](Self::cpus_per_task)), as far as this
    /// process may use them; else its share of the CPUs this process may use (affinity
    /// mask and cgroup quota) among [`local_world_size`](Self::local_world_size) ranks
    /// (1 when the launcher does not say); at least 1. A pool as wide as the machine in
    /// every rank oversubscribes it `local_world_size` times over.
    pub fn compute_threads(&self) -> usize {
        use crate::sys::cpu;
        let usable = cpu::usable_cpus();
        match self.cpus_per_task {
            Some(c) => c.min(usable).max(1),
            None => cpu::share_of(self.local_world_size.unwrap_or(1), usable),
        }
    }
}

/// The variables one launcher family sets.
struct Family {
    source: &'static str,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
    /// Whether the size variable without the rank variable is a contradiction. Slurm's
    /// `salloc` exports `SLURM_NTASKS` into the allocation's interactive shell, where no
    /// task exists yet, so for Slurm it only means "not started by srun".
    lone_size_is_error: bool,
}

/// Whether a Slurm step runs this process. `SLURM_PROCID`/`SLURM_NTASKS` describe a
/// task only inside a step (srun); the batch script of `sbatch` and the shell of
/// `salloc` see the allocation's values, with no step id.
fn in_slurm_step(var: &impl Fn(&str) -> Option<String>) -> bool {
    var("SLURM_STEP_ID")
        .or_else(|| var("SLURM_STEPID"))
        .is_some()
}

/// The job identity of [`LaunchEnv::job_id`], from the variables of the launcher that
/// started this process (`source`) and `ferroccl launch`'s own.
fn job_identity(source: &str, var: &impl Fn(&str) -> Option<String>) -> Option<String> {
    if let Some(id) = var("FERROCCL_JOB_ID") {
        return Some(format!("ferroccl launch job {id}"));
    }
    let slurm_step = || {
        let job = var("SLURM_JOB_ID").or_else(|| var("SLURM_JOBID"))?;
        let step = var("SLURM_STEP_ID").or_else(|| var("SLURM_STEPID"))?;
        Some(format!("Slurm job {job} step {step}"))
    };
    let own = match source {
        // rdzv-id "none" is torchrun's default: the same for every job.
        "torchrun" => {
            let attempt = var("TORCHELASTIC_RESTART_COUNT");
            match (
                var("TORCHELASTIC_RUN_ID").filter(|id| id != "none"),
                attempt,
            ) {
                (Some(id), attempt) => Some(format!(
                    "torchrun run {id} attempt {}",
                    attempt.as_deref().unwrap_or("0")
                )),
                // The default rdzv id, "none", names no job; the attempt still tells
                // a restarted job from the one before it.
                (None, Some(attempt)) => Some(format!("torchrun attempt {attempt}")),
                (None, None) => None,
            }
        }
        "openmpi" => var("PMIX_NAMESPACE")
            .map(|ns| format!("Open MPI job {ns}"))
            .or_else(|| var("OMPI_MCA_ess_base_jobid").map(|j| format!("Open MPI job {j}"))),
        "pmi" => var("PMI_KVSNAME").map(|kvs| format!("PMI job {kvs}")),
        _ => None,
    };
    own.or_else(slurm_step)
}

/// Launcher families, in order of precedence.
const FAMILIES: [Family; 4] = [
    Family {
        source: "torchrun",
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: "LOCAL_WORLD_SIZE",
        lone_size_is_error: true,
    },
    Family {
        source: "openmpi",
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
        lone_size_is_error: true,
    },
    Family {
        source: "pmi",
        rank: "PMI_RANK",
        size: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_size: "MPI_LOCALNRANKS",
        lone_size_is_error: true,
    },
    Family {
        source: "slurm",
        rank: "SLURM_PROCID",
        size: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_size: "SLURM_NTASKS_PER_NODE",
        lone_size_is_error: false,
    },
];

/// Reads the launcher environment of this process; `Ok(None)` when no launcher set one.
pub fn detect_env() -> Result<Option<LaunchEnv>> {
    detect_from(|k| std::env::var(k).ok())
}

/// [`detect_env`] over any variable lookup (for tests).
///
/// The first family whose rank variable is set wins: torchrun (`RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK`), Open MPI (`OMPI_COMM_WORLD_*`), PMI (`PMI_RANK`, `PMI_SIZE`,
/// `MPI_LOCALRANKID`), Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
/// `MASTER_ADDR` and `MASTER_PORT` are read whatever the family. Values are trimmed, and
/// a variable set to the empty string counts as unset. Anything incomplete or out of
/// range is an [`Error::Env`] naming the variables.
pub fn detect_from(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>> {
    let var = |name: &str| {
        get(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    for fam in &FAMILIES {
        if fam.source == "slurm" && !in_slurm_step(&var) {
            // sbatch's script, salloc's shell: the allocation, not a task of a step.
            continue;
        }
        let (rank, size) = match (var(fam.rank), var(fam.size)) {
            (Some(rank), Some(size)) => (rank, size),
            (None, None) => continue,
            (None, Some(_)) if !fam.lone_size_is_error => continue,
            (None, Some(size)) => {
                return Err(Error::Env(format!(
                "{}={size} is set but {} is not; {} sets both, so the environment is incomplete",
                fam.size, fam.rank, fam.source
            )))
            }
            (Some(rank), None) => {
                return Err(Error::Env(format!(
                "{}={rank} is set but {} is not; {} sets both, so the environment is incomplete",
                fam.rank, fam.size, fam.source
            )))
            }
        };
        let rank = parse_index(fam.rank, &rank)?;
        let world_size = parse_index(fam.size, &size)?;
        if world_size == 0 {
            return Err(Error::Env(format!(
                "{}=0: a job needs at least one rank",
                fam.size
            )));
        }
        if rank >= world_size {
            return Err(Error::Env(format!(
                "{}={rank} is out of range for {}={world_size} (ranks are 0..{world_size})",
                fam.rank, fam.size
            )));
        }
        let local_rank = match var(fam.local_rank) {
            None => None,
            Some(v) => {
                let local = parse_index(fam.local_rank, &v)?;
                if local >= world_size {
                    return Err(Error::Env(format!(
                        "{}={local} is not below {}={world_size}",
                        fam.local_rank, fam.size
                    )));
                }
                Some(local)
            }
        };
        let local_world_size = match var(fam.local_size) {
            None => None,
            Some(v) => {
                let k = parse_index(fam.local_size, &v)?;
                if k == 0 || k > world_size || local_rank.is_some_and(|l| l >= k) {
                    return Err(Error::Env(format!(
                        "{}={k} is not a number of this host's ranks: {}={world_size}{}",
                        fam.local_size,
                        fam.size,
                        local_rank.map_or(String::new(), |l| format!(", {}={l}", fam.local_rank))
                    )));
                }
                Some(k)
            }
        };
        let cpus_per_task = match var("SLURM_CPUS_PER_TASK") {
            Some(v) if fam.source == "slurm" => match parse_index("SLURM_CPUS_PER_TASK", &v)? {
                0 => {
                    return Err(Error::Env(
                        "SLURM_CPUS_PER_TASK=0 is not a number of CPUs".into(),
                    ))
                }
                c => Some(c),
            },
            _ => None,
        };
        let master_port = var("MASTER_PORT").map(|p| parse_port(&p)).transpose()?;
        let rdma_gid_index = var("FERROCCL_RDMA_GID_INDEX")
            .map(|v| parse_var("FERROCCL_RDMA_GID_INDEX", &v, "a GID table index (0..=255)"))
            .transpose()?;
        let trace_capacity = var("FERROCCL_TRACE_CAPACITY")
            .map(|v| parse_var("FERROCCL_TRACE_CAPACITY", &v, "a number of operations"))
            .transpose()?;
        let busy_poll_us = var("FERROCCL_BUSY_POLL_US")
            .map(|v| parse_var("FERROCCL_BUSY_POLL_US", &v, "a number of microseconds"))
            .transpose()?;
        return Ok(Some(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            cpus_per_task,
            master_addr: var("MASTER_ADDR"),
            master_port,
            source: fam.source,
            token: var("FERROCCL_TOKEN"),
            rdma_gid_index,
            trace_capacity,
            busy_poll_us,
            job_id: job_identity(fam.source, &var),
            algo: var("FERROCCL_ALGO"),
            cost_model: var("FERROCCL_COST_MODEL"),
            agent_store: fam.source == "torchrun"
                && var("TORCHELASTIC_USE_AGENT_STORE")
                    .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1")),
            transport: var("FERROCCL_TRANSPORT").map(|v| v.trim().to_string()),
            tcp_congestion: var("FERROCCL_TCP_CONGESTION").map(|v| v.trim().to_string()),
            shm_single_copy: var("FERROCCL_SHM_SINGLE_COPY").map(|v| v.trim().to_string()),
            shm_symmetric: var("FERROCCL_SHM_SYMMETRIC").map(|v| v.trim().to_string()),
            cuda_order: var("FERROCCL_CUDA_ORDER").map(|v| v.trim().to_string()),
            bind: var("FERROCCL_BIND").map(|v| v.trim().to_string()),
        }));
    }
    Ok(None)
}

/// Parses a ferroccl variable's value, or says which variable is not `what`.
fn parse_var<T: std::str::FromStr>(name: &str, value: &str, what: &str) -> Result<T> {
    value
        .trim()
        .parse()
        .map_err(|_| Error::Env(format!("{name}='{value}' is not {what}")))
}

/// Parses a rank, size or local rank.
fn parse_index(name: &str, value: &str) -> Result<usize> {
    if let Some(digits) = value.strip_prefix('-') {
        if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(Error::Env(format!(
                "{name}={value} is negative; it must be a non-negative integer"
            )));
        }
    }
    value.parse::<usize>().map_err(|e| {
        let why = match e.kind() {
            std::num::IntErrorKind::PosOverflow => "is too large",
            _ => "is not a non-negative integer",
        };
        Error::Env(format!("{name}='{value}' {why}"))
    })
}

/// Parses `MASTER_PORT`.
fn parse_port(value: &str) -> Result<u16> {
    match value.parse::<u16>() {
        Ok(0) => Err(Error::Env(
            "MASTER_PORT=0 is not usable: rank 0 serves the store on a fixed port that every \
             rank must know in advance"
                .into(),
        )),
        Ok(port) => Ok(port),
        Err(_) => Err(Error::Env(format!(
            "MASTER_PORT='{value}' is not a TCP port (1..=65535)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    type Vars = Vec<(&'static str, &'static str)>;

    fn detect(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect_from(|k| map.get(k).cloned())
    }

    #[test]
    fn ferroccl_knobs_are_read_trimmed() {
        let e = detect(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("FERROCCL_TRANSPORT", " tcp "),
            ("FERROCCL_TCP_CONGESTION", "cubic\n"),
            ("FERROCCL_SHM_SINGLE_COPY", " off"),
            ("FERROCCL_SHM_SYMMETRIC", "off "),
            ("FERROCCL_CUDA_ORDER", " device\n"),
            ("FERROCCL_BIND", " on"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(e.transport.as_deref(), Some("tcp"));
        assert_eq!(e.tcp_congestion.as_deref(), Some("cubic"));
        assert_eq!(e.shm_single_copy.as_deref(), Some("off"));
        assert_eq!(e.shm_symmetric.as_deref(), Some("off"));
        assert_eq!(e.cuda_order.as_deref(), Some("device"));
        assert_eq!(e.bind.as_deref(), Some("on"));
    }

    fn env(
        source: &'static str,
        rank: usize,
        world_size: usize,
        local_rank: Option<usize>,
    ) -> LaunchEnv {
        LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size: None,
            cpus_per_task: None,
            master_addr: None,
            master_port: None,
            source,
            token: None,
            rdma_gid_index: None,
            trace_capacity: None,
            busy_poll_us: None,
            job_id: None,
            algo: None,
            cost_model: None,
            agent_store: false,
            transport: None,
            tcp_congestion: None,
            shm_single_copy: None,
            shm_symmetric: None,
            cuda_order: None,
            bind: None,
        }
    }

    #[test]
    fn rdma_gid_index_is_read_and_checked() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "2")];
        let get = |extra: &[(&str, &str)]| {
            let map: HashMap<String, String> = base
                .iter()
                .chain(extra)
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            detect_from(|k| map.get(k).cloned())
        };
        assert_eq!(get(&[]).unwrap().unwrap().rdma_gid_index, None);
        let e = get(&[("FERROCCL_RDMA_GID_INDEX", "3")]).unwrap().unwrap();
        assert_eq!(e.rdma_gid_index, Some(3));
        let bad = get(&[("FERROCCL_RDMA_GID_INDEX", "300")]).unwrap_err();
        assert!(
            bad.to_string().contains("FERROCCL_RDMA_GID_INDEX='300'"),
            "{bad}"
        );
    }

    #[test]
    fn each_family_says_how_many_ranks_share_the_host() {
        for (vars, want) in [
            (
                vec![
                    ("RANK", "1"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                2,
            ),
            (
                vec![
                    ("OMPI_COMM_WORLD_RANK", "0"),
                    ("OMPI_COMM_WORLD_SIZE", "8"),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "8"),
                ],
                8,
            ),
            (
                vec![
                    ("PMI_RANK", "0"),
                    ("PMI_SIZE", "6"),
                    ("MPI_LOCALNRANKS", "3"),
                ],
                3,
            ),
            (
                vec![
                    ("SLURM_PROCID", "5"),
                    ("SLURM_NTASKS", "7"),
                    ("SLURM_STEP_ID", "0"),
                    ("SLURM_NTASKS_PER_NODE", "4"),
                ],
                4,
            ),
        ] {
            let e = detect(&vars).unwrap().unwrap();
            assert_eq!(e.local_world_size, Some(want), "{vars:?}");
        }
        let e = detect(&[("RANK", "0"), ("WORLD_SIZE", "2")])
            .unwrap()
            .unwrap();
        assert_eq!(e.local_world_size, None);
        // Its compute threads: all this process may use when alone on the host, and
        // one each when the host has more ranks than that.
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
        let alone = e.compute_threads();
        let crowd = LaunchEnv {
            local_world_size: Some(usable * 4),
            ..e
        };
        assert_eq!(crowd.compute_threads(), 1);
        assert_eq!(alone, usable);
    }

    #[test]
    fn slurm_cpus_per_task_sizes_the_compute_threads() {
        let usable = std::thread::available_parallelism().map_or(1, |n| n.get());
        let srun = |cpus: &'static str| {
            detect(&[
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_NTASKS_PER_NODE", "4"),
                ("SLURM_CPUS_PER_TASK", cpus),
            ])
        };
        let e = srun("3").unwrap().unwrap();
        assert_eq!(e.cpus_per_task, Some(3));
        // Its 3 CPUs, not a quarter of the host (as far as this process may use them).
        assert_eq!(e.compute_threads(), usable.min(3));
        let wide = LaunchEnv {
            cpus_per_task: Some(usable + 5),
            ..e
        };
        assert_eq!(wide.compute_threads(), usable);
        for bad in ["0", "x", "-2"] {
            let err = srun(bad).unwrap_err().to_string();
            assert!(err.contains("SLURM_CPUS_PER_TASK"), "{bad}: {err}");
        }
        // Outside an srun task the variable belongs to the allocation, not this rank.
        let torch = detect(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("SLURM_CPUS_PER_TASK", "3"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(torch.cpus_per_task, None);
    }

    #[test]
    fn env_detects_each_family_in_order_of_precedence() {
        let torch = [("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")];
        let ompi = [
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ];
        let pmi = [
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "6"),
            ("MPI_LOCALRANKID", "2"),
        ];
        let slurm = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "7"),
            ("SLURM_LOCALID", "3"),
            ("SLURM_STEP_ID", "0"),
        ];
        let all: Vec<_> = [&torch[..], &ompi, &pmi, &slurm].concat();
        let cases: Vec<(Vars, Option<LaunchEnv>)> = vec![
            (vec![], None),
            (torch.to_vec(), Some(env("torchrun", 1, 4, Some(1)))),
            (ompi.to_vec(), Some(env("openmpi", 2, 8, Some(0)))),
            (pmi.to_vec(), Some(env("pmi", 3, 6, Some(2)))),
            (slurm.to_vec(), Some(env("slurm", 5, 7, Some(3)))),
            (all.clone(), Some(env("torchrun", 1, 4, Some(1)))),
            (all[3..].to_vec(), Some(env("openmpi", 2, 8, Some(0)))),
            (all[6..].to_vec(), Some(env("pmi", 3, 6, Some(2)))),
            // PMI without MPI_LOCALRANKID, torchrun without LOCAL_RANK.
            (pmi[..2].to_vec(), Some(env("pmi", 3, 6, None))),
            (torch[..2].to_vec(), Some(env("torchrun", 1, 4, None))),
            // Values are trimmed; an empty variable counts as unset.
            (
                vec![("RANK", " 0 "), ("WORLD_SIZE", "1\n")],
                Some(env("torchrun", 0, 1, None)),
            ),
            (vec![("RANK", ""), ("WORLD_SIZE", "")], None),
            // salloc exports SLURM_NTASKS without a task id: not a launch.
            (vec![("SLURM_NTASKS", "4")], None),
            // A local rank from another family is not mixed in.
            (
                vec![("PMI_RANK", "0"), ("PMI_SIZE", "2"), ("SLURM_LOCALID", "1")],
                Some(env("pmi", 0, 2, None)),
            ),
        ];
        for (vars, want) in cases {
            let got = detect(&vars);
            assert_eq!(got.as_ref().ok(), Some(&want), "for {vars:?} got {got:?}");
        }
    }

    #[test]
    fn slurm_variables_count_only_inside_a_step() {
        // What sbatch's batch script sees for a 3-task allocation: no step id.
        let batch = [
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "3"),
            ("SLURM_LOCALID", "0"),
        ];
        assert_eq!(
            detect(&batch).ok(),
            Some(None),
            "a batch script is not a task"
        );
        // Even an inconsistent allocation environment is not this process's concern.
        assert_eq!(detect(&[("SLURM_PROCID", "7")]).ok(), Some(None));
        // srun inside it: step 0, task 2 of 3.
        let step = [
            ("SLURM_JOB_ID", "4242"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "3"),
            ("SLURM_LOCALID", "2"),
        ];
        let got = detect(&step).unwrap().unwrap();
        assert_eq!((got.source, got.rank, got.world_size), ("slurm", 2, 3));
        assert_eq!(got.job_id.as_deref(), Some("Slurm job 4242 step 0"));
        // Old Slurm spells it SLURM_STEPID.
        let old = [
            ("SLURM_JOBID", "9"),
            ("SLURM_STEPID", "3"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ];
        let got = detect(&old).unwrap().unwrap();
        assert_eq!(got.job_id.as_deref(), Some("Slurm job 9 step 3"));
    }

    #[test]
    fn job_identity_comes_from_the_launcher_that_started_the_rank() {
        let id = |vars: &[(&str, &str)]| detect(vars).unwrap().unwrap().job_id;
        let torch = [("RANK", "0"), ("WORLD_SIZE", "2")];
        let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&str, &str)> {
            torch.iter().chain(extra).copied().collect()
        };
        assert_eq!(id(&torch), None);
        assert_eq!(
            id(&with(&[
                ("TORCHELASTIC_RUN_ID", "abc"),
                ("TORCHELASTIC_RESTART_COUNT", "2")
            ])),
            Some("torchrun run abc attempt 2".into())
        );
        // torchrun's default rdzv id is "none" for every job: only the attempt counts.
        assert_eq!(id(&with(&[("TORCHELASTIC_RUN_ID", "none")])), None);
        assert_eq!(
            id(&with(&[
                ("TORCHELASTIC_RUN_ID", "none"),
                ("TORCHELASTIC_RESTART_COUNT", "1")
            ])),
            Some("torchrun attempt 1".into())
        );
        // ferroccl launch's own id wins, also over an enclosing Slurm step.
        assert_eq!(
            id(&with(&[
                ("FERROCCL_JOB_ID", "7f3a"),
                ("TORCHELASTIC_RUN_ID", "abc"),
                ("SLURM_JOB_ID", "5"),
                ("SLURM_STEP_ID", "0")
            ])),
            Some("ferroccl launch job 7f3a".into())
        );
        let ompi = [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let mut v = ompi.to_vec();
        v.push(("OMPI_MCA_ess_base_jobid", "123456"));
        assert_eq!(id(&v), Some("Open MPI job 123456".into()));
        v.push(("PMIX_NAMESPACE", "prterun-n1-77@1"));
        assert_eq!(id(&v), Some("Open MPI job prterun-n1-77@1".into()));
        // PMI under srun --mpi=pmi2: the Slurm step names the job.
        let pmi = [
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("SLURM_JOB_ID", "88"),
            ("SLURM_STEP_ID", "4"),
        ];
        assert_eq!(id(&pmi), Some("Slurm job 88 step 4".into()));
        let mut pmi = pmi.to_vec();
        pmi.push(("PMI_KVSNAME", "kvs_991_0"));
        assert_eq!(id(&pmi), Some("PMI job kvs_991_0".into()));
    }

    #[test]
    fn agent_store_is_read_only_from_torchrun() {
        let get = |v: &[(&str, &str)]| detect(v).unwrap().unwrap().agent_store;
        assert!(!get(&[("RANK", "0"), ("WORLD_SIZE", "1")]));
        for yes in ["True", "true", "1"] {
            assert!(get(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "1"),
                ("TORCHELASTIC_USE_AGENT_STORE", yes)
            ]));
        }
        assert!(!get(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "False")
        ]));
        assert!(!get(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "1"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True")
        ]));
    }

    #[test]
    fn env_reads_master_whatever_the_family() {
        for family in [
            [("RANK", "0"), ("WORLD_SIZE", "2")],
            [("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")],
            [("PMI_RANK", "0"), ("PMI_SIZE", "2")],
            [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")],
        ] {
            let mut family = family.to_vec();
            family.push(("SLURM_STEP_ID", "1"));
            let mut vars = family.to_vec();
            vars.push(("MASTER_ADDR", "node17.cluster"));
            vars.push(("MASTER_PORT", "29500"));
            let got = detect(&vars).ok().flatten();
            let got = got.unwrap_or_else(|| panic!("nothing detected from {vars:?}"));
            assert_eq!(got.master_addr.as_deref(), Some("node17.cluster"));
            assert_eq!(got.master_port, Some(29500));
        }
    }

    #[test]
    fn env_errors_name_the_variables() {
        // (variables, substrings the Error::Env message must contain)
        let cases: Vec<(Vars, Vec<&str>)> = vec![
            (vec![("RANK", "0")], vec!["RANK=0", "WORLD_SIZE"]),
            (vec![("WORLD_SIZE", "4")], vec!["WORLD_SIZE=4", "RANK"]),
            // torchrun's contradiction is reported even when Slurm variables are set.
            (
                vec![
                    ("WORLD_SIZE", "4"),
                    ("SLURM_PROCID", "0"),
                    ("SLURM_NTASKS", "4"),
                ],
                vec!["WORLD_SIZE=4", "RANK"],
            ),
            (
                vec![("OMPI_COMM_WORLD_RANK", "1")],
                vec!["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"],
            ),
            (
                vec![("OMPI_COMM_WORLD_SIZE", "2")],
                vec!["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"],
            ),
            (vec![("PMI_SIZE", "2")], vec!["PMI_SIZE", "PMI_RANK"]),
            (vec![("PMI_RANK", "2")], vec!["PMI_RANK", "PMI_SIZE"]),
            (
                vec![("SLURM_PROCID", "2"), ("SLURM_STEP_ID", "0")],
                vec!["SLURM_PROCID", "SLURM_NTASKS"],
            ),
            (
                vec![("RANK", "abc"), ("WORLD_SIZE", "4")],
                vec!["RANK='abc'", "integer"],
            ),
            (
                vec![("RANK", "1.5"), ("WORLD_SIZE", "4")],
                vec!["RANK='1.5'"],
            ),
            (
                vec![("RANK", "-1"), ("WORLD_SIZE", "4")],
                vec!["RANK=-1", "negative"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "-4")],
                vec!["WORLD_SIZE=-4", "negative"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "99999999999999999999999")],
                vec!["WORLD_SIZE", "too large"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "0")],
                vec!["WORLD_SIZE=0"],
            ),
            (
                vec![("RANK", "4"), ("WORLD_SIZE", "4")],
                vec!["RANK=4", "WORLD_SIZE=4"],
            ),
            (
                vec![
                    ("SLURM_PROCID", "9"),
                    ("SLURM_NTASKS", "3"),
                    ("SLURM_STEP_ID", "0"),
                ],
                vec!["SLURM_PROCID=9", "SLURM_NTASKS=3"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "4")],
                vec!["LOCAL_RANK=4", "WORLD_SIZE=4"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "x")],
                vec!["LOCAL_RANK='x'"],
            ),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", "5"),
                ],
                vec!["LOCAL_WORLD_SIZE=5", "WORLD_SIZE=4"],
            ),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                vec!["LOCAL_WORLD_SIZE=2", "LOCAL_RANK=2"],
            ),
            (
                vec![
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", "0"),
                ],
                vec!["LOCAL_WORLD_SIZE=0"],
            ),
            (
                vec![
                    ("PMI_RANK", "0"),
                    ("PMI_SIZE", "2"),
                    ("MPI_LOCALRANKID", "-1"),
                ],
                vec!["MPI_LOCALRANKID=-1"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "http")],
                vec!["MASTER_PORT='http'"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "70000")],
                vec!["MASTER_PORT='70000'"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "-1")],
                vec!["MASTER_PORT='-1'"],
            ),
            (
                vec![("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_PORT", "0")],
                vec!["MASTER_PORT=0"],
            ),
        ];
        for (vars, needles) in cases {
            match detect(&vars) {
                Err(Error::Env(msg)) => {
                    for needle in needles {
                        assert!(msg.contains(needle), "{vars:?}: '{msg}' lacks '{needle}'");
                    }
                }
                other => panic!("{vars:?}: expected Error::Env, got {other:?}"),
            }
        }
    }
}
