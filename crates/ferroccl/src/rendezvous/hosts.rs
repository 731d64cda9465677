//! Which ranks share a host: every rank's host identity, traded through the store once
//! when the communicator is made, the same list on every rank whatever the transport.
//! The hierarchical algorithms are laid out by it, `split_by_host` splits by it, a
//! waiter decides by it whether this host runs more ranks than CPUs, and the
//! shared-memory transport links by it.
//!
//! "One host" is the same boot id, hostname, effective user and network, IPC and mount
//! namespaces ([`identity`]): ranks in different network namespaces, as on
//! `tools/emulated-cluster`, are different hosts, and so are ranks of different users
//! (shared-memory segments are `0600`). Two ranks are on one host when the two strings
//! are equal, so both sides always agree.

use super::StoreClient;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// This process's host identity (see the module docs), with `tag` appended when it is
/// not empty (tests emulate several hosts with threads of one process that way).
pub(crate) fn identity(tag: &str) -> String {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|e| format!("?{e}"))
    };
    let ns = |n: &str| {
        std::fs::read_link(format!("/proc/self/ns/{n}"))
            .map(|p| p.display().to_string())
            .unwrap_or_else(|e| format!("?{e}"))
    };
    let mut me = format!(
        "boot={} host={} uid={} {} {} {}",
        read("/proc/sys/kernel/random/boot_id"),
        read("/proc/sys/kernel/hostname"),
        crate::sys::shm::effective_uid(),
        ns("net"),
        ns("ipc"),
        ns("mnt"),
    );
    if !tag.is_empty() {
        me.push_str(&format!(" tag={tag}"));
    }
    me
}

/// The first byte of a list rank 0 could not make: the rest says why.
const FAILED: u8 = b'!';

/// Says which host this rank is on: `host/<rank>` = `me` ([`identity`]). Done before
/// the transport links (a transport may read its peers' with [`of_rank`]).
pub(crate) fn publish(store: &mut StoreClient, rank: usize, me: &str) -> Result<()> {
    store.set(&format!("host/{rank}"), me.as_bytes())
}

/// Which host rank `peer` said it is on, waiting for it until `deadline`.
pub(crate) fn of_rank(
    store: &mut StoreClient,
    rank: usize,
    peer: usize,
    deadline: Instant,
) -> Result<String> {
    let wait = deadline.saturating_duration_since(Instant::now());
    store
        .get(&format!("host/{peer}"), wait)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .map_err(|e| {
            Error::Rendezvous(format!(
                "rank {rank}: rank {peer} did not publish which host it is on within {wait:?}: \
                 has it started, with the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE? ({e})"
            ))
        })
}

/// Every rank's host identity, in rank order, the same list on every rank, once every
/// rank has [`publish`]ed its own: rank 0 reads each `host/<rank>` (within `wait` in
/// all) and publishes the list as `hosts` (each distinct host once, and per rank an
/// index into them, so the list stays small for large jobs); the others read that one
/// key. A rank that never says is named: rank 0 publishes why it has no list, so every
/// rank reports it.
pub(crate) fn collect(
    store: &mut StoreClient,
    rank: usize,
    n: usize,
    wait: Duration,
) -> Result<Vec<String>> {
    if rank == 0 {
        let deadline = Instant::now() + wait;
        let mut all = Vec::with_capacity(n);
        for r in 0..n {
            match of_rank(store, 0, r, deadline) {
                Ok(id) => all.push(id),
                Err(e) => {
                    let why = format!(
                        "rank {r} did not publish which host it is on within {wait:?}: has it \
                         started, with the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE?"
                    );
                    let mut note = vec![FAILED];
                    note.extend_from_slice(why.as_bytes());
                    // Best effort: the others time out on their own otherwise.
                    let _ = store.set("hosts", &note);
                    return Err(match e {
                        Error::Rendezvous(m) => Error::Rendezvous(m),
                        e => e,
                    });
                }
            }
        }
        store.set("hosts", &encode(&all)?)?;
        return Ok(all);
    }
    // Rank 0 waits up to `wait` for the last rank; give it that and as long again.
    let list = store.get("hosts", 2 * wait).map_err(|e| {
        Error::Rendezvous(format!(
            "rank {rank}: rank 0 did not publish the job's host list within {:?}: has it \
             started, with the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE? ({e})",
            2 * wait
        ))
    })?;
    if let Some(why) = list.strip_prefix(&[FAILED]) {
        return Err(Error::Rendezvous(format!(
            "rank {rank}: {} (rank 0 found)",
            String::from_utf8_lossy(why)
        )));
    }
    decode(&list, n)
        .ok_or_else(|| Error::Rendezvous(format!("rank {rank}: the job's host list is malformed")))
}

/// The list as published: `{"hosts": [distinct identities], "of": [index per rank]}`.
fn encode(all: &[String]) -> Result<Vec<u8>> {
    let mut hosts: Vec<&str> = Vec::new();
    let mut index = std::collections::HashMap::new();
    let of: Vec<usize> = all
        .iter()
        .map(|h| {
            *index.entry(h.as_str()).or_insert_with(|| {
                hosts.push(h);
                hosts.len() - 1
            })
        })
        .collect();
    let v = serde_json::json!({ "hosts": hosts, "of": of });
    let bytes = serde_json::to_vec(&v).map_err(|e| Error::Rendezvous(e.to_string()))?;
    if bytes.len() > super::MAX_VALUE_LEN {
        return Err(Error::Rendezvous(format!(
            "the job's host list ({} distinct hosts, {} ranks) takes {} bytes, more than the \
             store holds in one value ({})",
            hosts.len(),
            all.len(),
            bytes.len(),
            super::MAX_VALUE_LEN
        )));
    }
    Ok(bytes)
}

/// [`encode`]'s list of `n` ranks, or `None` if it is not one.
fn decode(bytes: &[u8], n: usize) -> Option<Vec<String>> {
    #[derive(serde::Deserialize)]
    struct List {
        hosts: Vec<String>,
        of: Vec<usize>,
    }
    let l: List = serde_json::from_slice(bytes).ok()?;
    if l.of.len() != n {
        return None;
    }
    l.of.iter().map(|&i| l.hosts.get(i).cloned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_names_the_namespaces_and_the_tag() {
        let me = identity("");
        assert!(me.contains("boot=") && me.contains("net:["), "{me}");
        assert_eq!(me, identity(""), "stable within a process");
        assert_eq!(identity("x"), format!("{me} tag=x"));
    }

    #[test]
    fn lists_round_trip_with_each_host_once() {
        let all: Vec<String> = ["b", "a", "b", "c", "a"].map(String::from).to_vec();
        let bytes = encode(&all).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert_eq!(text.matches("\"b\"").count(), 1, "{text}");
        assert_eq!(decode(&bytes, 5), Some(all));
        // Another world size, an index out of range, not JSON: refused.
        assert_eq!(decode(&bytes, 4), None);
        assert_eq!(decode(br#"{"hosts":["a"],"of":[0,1]}"#, 2), None);
        assert_eq!(decode(b"[\"a\"]", 1), None);
        // 100k ranks on 1,000 hosts fit one store value.
        let many: Vec<String> = (0..100_000)
            .map(|r| format!("{} {}", identity(""), r / 100))
            .collect();
        assert!(encode(&many).is_ok());
    }
}
