//! `select.rs`'s unit tests: every switch point, as a pure function of the policy.
use super::*;

const SEG: usize = 512 << 10;

fn policy(n: usize, layout: Option<&HostLayout>) -> Policy<'_> {
    Policy {
        world_size: n,
        host_pull: false,
        pull_max: usize::MAX,
        sym: false,
        slot_bytes: 0,
        layout,
        forced: AllReduceAlgo::Auto,
        small_message_bytes: 64 << 10,
        segment_bytes: SEG,
        model: None,
    }
}

#[test]
fn auto_takes_doubling_for_small_messages_and_the_ring_above() {
    let p = policy(4, None);
    assert_eq!(p.all_reduce(1024), Algorithm::RecursiveDoubling);
    assert_eq!(p.all_reduce(64 << 10), Algorithm::RecursiveDoubling);
    assert_eq!(p.all_reduce((64 << 10) + 1), Algorithm::Ring);
    // One frame of the whole buffer: never above 4 GiB.
    let big = Policy {
        small_message_bytes: usize::MAX,
        ..p
    };
    assert_eq!(big.all_reduce(u32::MAX as usize + 1), Algorithm::Ring);
    // One rank: nothing to choose.
    assert_eq!(policy(1, None).all_reduce(8), Algorithm::Ring);
    assert_eq!(p.rooted(), Algorithm::Chain);
    assert_eq!(p.reduce_scatter(), Algorithm::Ring);
}

#[test]
fn hosts_of_equal_size_take_the_hierarchical_algorithms_and_others_refuse_them() {
    let even = HostLayout::from_hosts(&["a", "a", "b", "b"]);
    let p = policy(4, Some(&even));
    assert_eq!(p.hierarchical_shape(), Some((2, 2)));
    assert_eq!(p.all_reduce(1 << 20), Algorithm::Hierarchical);
    assert_eq!(p.all_reduce(1024), Algorithm::RecursiveDoubling);
    assert_eq!(p.reduce_scatter(), Algorithm::Hierarchical);
    assert!(p.runnable(Algorithm::Hierarchical).is_ok());
    // Hosts of one rank, or one host: the flat algorithms.
    let singles = HostLayout::from_hosts(&["a", "b", "c"]);
    assert_eq!(
        policy(3, Some(&singles)).all_reduce(1 << 20),
        Algorithm::Ring
    );
    // Uneven hosts: auto takes the ring; forced, it is refused saying why.
    let uneven = HostLayout::from_hosts(&["a", "a", "b"]);
    let mut p = policy(3, Some(&uneven));
    assert_eq!(p.all_reduce(1 << 20), Algorithm::Ring);
    p.forced = AllReduceAlgo::Hierarchical;
    assert_eq!(p.all_reduce(1 << 20), Algorithm::Hierarchical);
    let why = p.runnable(Algorithm::Hierarchical).unwrap_err();
    assert!(why.contains("different numbers of ranks (2, 1)"), "{why}");
    // No layout, and memory peers: refused too.
    assert!(policy(3, None)
        .runnable(Algorithm::Hierarchical)
        .unwrap_err()
        .contains("share a host"));
    let pulled = Policy {
        host_pull: true,
        ..policy(4, Some(&even))
    };
    assert_eq!(pulled.hierarchical_shape(), None);
    assert_eq!(pulled.all_reduce(1 << 20), Algorithm::TwoShot);
    assert!(pulled.runnable(Algorithm::Hierarchical).is_err());
    // Any other algorithm runs flat.
    assert_eq!(pulled.runnable(Algorithm::Ring).unwrap().1, None);
    assert_eq!(
        policy(4, Some(&even))
            .runnable(Algorithm::Hierarchical)
            .unwrap(),
        (Algorithm::Hierarchical, Some(even.clone()))
    );
}

/// Memory peers (symmetric memory): recursive doubling over the links up to
/// `sym_push_max(n)`, one-shot up to `one_shot_max(n)`, two-shot above; forced
/// shots and the ring read the peers' memory, forced streaming algorithms stream;
/// a rank alone runs the ring.
#[test]
fn memory_peers_stream_small_messages_and_read_large_ones() {
    for n in [2, 3, 4, 5, 8] {
        let p = Policy {
            host_pull: true,
            ..policy(n, None)
        };
        let m = sym_push_max(n).max(one_shot_max(n));
        assert_eq!(p.all_reduce(0), Algorithm::RecursiveDoubling);
        assert_eq!(p.all_reduce(sym_push_max(n)), Algorithm::RecursiveDoubling);
        assert_eq!(p.all_reduce(m + 1), Algorithm::TwoShot, "n={n}");
        assert_eq!(p.all_reduce(1 << 30), Algorithm::TwoShot);
        assert!(!p.all_reduce_pulls(Algorithm::RecursiveDoubling, 1 << 20));
        assert!(p.all_reduce_pulls(Algorithm::TwoShot, 1 << 20));
        for (forced, want) in [
            (AllReduceAlgo::OneShot, Algorithm::OneShot),
            (AllReduceAlgo::TwoShot, Algorithm::TwoShot),
            (AllReduceAlgo::Ring, Algorithm::Ring),
            (AllReduceAlgo::Tree, Algorithm::Tree),
            (AllReduceAlgo::Rabenseifner, Algorithm::Rabenseifner),
            // One host: hierarchical's part within a host is two-shot.
            (AllReduceAlgo::Hierarchical, Algorithm::TwoShot),
        ] {
            let f = Policy { forced, ..p };
            assert_eq!(f.all_reduce(1 << 20), want, "n={n} {forced:?}");
            assert_eq!(f.all_reduce(16), want, "n={n} {forced:?}");
            let pulls = matches!(
                want,
                Algorithm::OneShot | Algorithm::TwoShot | Algorithm::Ring
            );
            assert_eq!(f.all_reduce_pulls(want, 1 << 20), pulls, "n={n} {forced:?}");
            let links = Policy {
                host_pull: false,
                ..f
            };
            assert!(!links.all_reduce_pulls(want, 1 << 20));
            if forced == AllReduceAlgo::Hierarchical {
                assert_eq!(f.reduce_scatter(), Algorithm::Ring);
                continue;
            }
            assert!(
                !matches!(
                    links.all_reduce(1 << 20),
                    Algorithm::OneShot | Algorithm::TwoShot
                ),
                "n={n} {forced:?} over links"
            );
        }
    }
    // Calls larger than the memory peers take stream: the ring, or what is forced.
    let capped = Policy {
        host_pull: true,
        pull_max: 1 << 20,
        ..policy(2, None)
    };
    assert_eq!(capped.all_reduce(1 << 20), Algorithm::TwoShot);
    assert_eq!(capped.all_reduce((1 << 20) + 8), Algorithm::Ring);
    assert!(!capped.all_reduce_pulls(Algorithm::Ring, (1 << 20) + 8));
    assert!(capped.pull(1 << 20) && !capped.pull((1 << 20) + 1));
    let forced = Policy {
        forced: AllReduceAlgo::TwoShot,
        ..capped
    };
    assert_eq!(forced.all_reduce(2 << 20), Algorithm::Ring);
    // Larger jobs read more per byte in one-shot: its limit never grows with n.
    assert!((2..64).all(|n| one_shot_max(n + 1) <= one_shot_max(n)));
    let alone = Policy {
        host_pull: true,
        ..policy(1, None)
    };
    assert_eq!(alone.all_reduce(1024), Algorithm::Ring);
}

/// On symmetric shared memory each collective but all-reduce reads the peers only
/// from its measured switch point ([`sym_pull_min`]: none today, so the rings at
/// every size); other memory peers (CUDA IPC's) take every call up to their cap;
/// links never pull.
#[test]
fn symmetric_memory_pulls_only_where_it_was_measured_to_win() {
    let sizes = [0usize, 1, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 1 << 30];
    for n in 1..=8 {
        for call in HostCall::ALL {
            assert_eq!(sym_pull_min(call, n), None, "{call:?} n={n}");
            for bytes in sizes {
                let sym = Policy {
                    host_pull: true,
                    sym: true,
                    pull_max: 1 << 30,
                    ..policy(n, None)
                };
                assert!(!sym.pulls(call, bytes), "{call:?} n={n} {bytes}");
                let ipc = Policy { sym: false, ..sym };
                assert!(ipc.pulls(call, bytes), "{call:?} n={n} {bytes}");
                let capped = Policy {
                    pull_max: bytes.saturating_sub(1),
                    ..ipc
                };
                assert_eq!(capped.pulls(call, bytes), bytes == 0, "{call:?} {bytes}");
                assert!(!policy(n, None).pulls(call, bytes));
            }
        }
        // The rooted collectives stream on symmetric memory, so a forced tree runs.
        let tree = Policy {
            host_pull: true,
            sym: true,
            forced: AllReduceAlgo::Tree,
            ..policy(n, None)
        };
        let want = if n > 1 {
            Algorithm::Tree
        } else {
            Algorithm::Chain
        };
        assert_eq!(tree.rooted(), want, "n={n}");
        assert_eq!(Policy { sym: false, ..tree }.rooted(), Algorithm::Chain);
        // All-reduce reads symmetric memory (two-shot) between the rings' small
        // sizes and their large ones; the ring's plan always streams there.
        if n > 1 {
            let auto = Policy {
                forced: AllReduceAlgo::Auto,
                pull_max: 1 << 30,
                ..tree
            };
            let (lo, hi) = (sym_push_max(n), sym_two_shot_max(n));
            assert!(lo < hi);
            assert_eq!(auto.all_reduce(lo), Algorithm::RecursiveDoubling);
            for b in [lo + 1, 1 << 20, hi] {
                assert_eq!(auto.all_reduce(b), Algorithm::TwoShot, "n={n} {b}");
                assert!(auto.all_reduce_pulls(Algorithm::TwoShot, b));
            }
            for b in [hi + 1, 1 << 30] {
                assert_eq!(auto.all_reduce(b), Algorithm::Ring, "n={n} {b}");
                assert!(!auto.all_reduce_pulls(Algorithm::Ring, b), "n={n} {b}");
            }
            // Forced, the ring streams; the shots read the peers at any size.
            let forced = |forced| Policy { forced, ..auto };
            assert_eq!(
                forced(AllReduceAlgo::Ring).all_reduce(1 << 20),
                Algorithm::Ring
            );
            assert!(!auto.all_reduce_pulls(Algorithm::Ring, 1 << 20));
            assert_eq!(
                forced(AllReduceAlgo::TwoShot).all_reduce(1 << 30),
                Algorithm::TwoShot
            );
            assert_eq!(
                forced(AllReduceAlgo::OneShot).all_reduce(16),
                Algorithm::OneShot
            );
            // Other memory peers keep two-shot at every size, and pull the ring.
            let ipc = Policy { sym: false, ..auto };
            assert_eq!(ipc.all_reduce(1 << 30), Algorithm::TwoShot);
            assert!(ipc.all_reduce_pulls(Algorithm::Ring, 1 << 20));
            // The blocks of two-shot: n segments, whole elements, at least n.
            for es in [1, 2, 4, 8] {
                let b = two_shot_block(n, es, 512 << 10);
                assert_eq!(b * es, n * (512 << 10), "n={n} es={es}");
                assert_eq!(two_shot_block(n, es, 1), n, "n={n} es={es}");
            }
        }
    }
}

/// Symmetric memory with slots: `auto` takes one-shot from the slots up to
/// `slot_max(n)` (never more than a slot holds), recursive doubling over the rings
/// from there to `sym_push_max(n)`; forced one-shot runs from the slots where the
/// buffer fits one and from the workspaces above; no slots, or memory peers that
/// are not symmetric memory, or a rank alone: never the slots.
#[test]
fn small_all_reduces_take_the_slots_where_there_are_some() {
    // What symmetric memory's slots hold (`transport/shm/sym.rs`).
    let slot = 32 << 10;
    for n in 1..=16 {
        assert!(
            slot_max(n) <= slot && slot_max(n) < sym_push_max(n),
            "n={n}"
        );
        let sym = Policy {
            host_pull: true,
            sym: true,
            slot_bytes: slot,
            pull_max: 1 << 30,
            ..policy(n, None)
        };
        let m = slot_max(n);
        for b in [0, 8, m] {
            let want = if n > 1 {
                Algorithm::OneShot
            } else {
                Algorithm::Ring
            };
            assert_eq!(sym.all_reduce(b), want, "n={n} {b}");
            assert_eq!(sym.all_reduce_slots(want, b), n > 1, "n={n} {b}");
        }
        if n == 1 {
            assert_eq!(sym.barrier(), Algorithm::RecursiveDoubling);
            continue;
        }
        assert_eq!(sym.all_reduce(m + 1), Algorithm::RecursiveDoubling, "n={n}");
        assert!(!sym.all_reduce_slots(Algorithm::RecursiveDoubling, m));
        let one = Policy {
            forced: AllReduceAlgo::OneShot,
            ..sym
        };
        assert_eq!(one.all_reduce(slot + 1), Algorithm::OneShot);
        assert!(one.all_reduce_slots(Algorithm::OneShot, slot));
        assert!(!one.all_reduce_slots(Algorithm::OneShot, slot + 1));
        for other in [
            Policy {
                slot_bytes: 0,
                ..sym
            },
            Policy {
                sym: false,
                slot_bytes: 0,
                ..sym
            },
            Policy {
                host_pull: false,
                ..sym
            },
        ] {
            for b in [0, 8] {
                assert_ne!(other.all_reduce(b), Algorithm::OneShot, "n={n} {other:?}");
                assert!(
                    !other.all_reduce_slots(Algorithm::OneShot, b),
                    "n={n} {other:?}"
                );
            }
        }
        // Where the slots hold less than `slot_max`, the rings take the rest.
        let small = Policy {
            slot_bytes: 64,
            ..sym
        };
        assert_eq!(small.all_reduce(64), Algorithm::OneShot);
        assert_eq!(small.all_reduce(65), Algorithm::RecursiveDoubling);
        // The barrier: from the slots where there are some, else over the links.
        assert_eq!(sym.barrier(), Algorithm::OneShot, "n={n}");
        for other in [
            Policy {
                slot_bytes: 0,
                ..sym
            },
            Policy {
                host_pull: false,
                ..sym
            },
            policy(n, None),
        ] {
            assert_eq!(other.barrier(), Algorithm::RecursiveDoubling, "n={n}");
        }
    }
}

#[test]
fn forced_algorithms_hold_where_they_can_run() {
    for (forced, want) in [
        (AllReduceAlgo::Ring, Algorithm::Ring),
        (
            AllReduceAlgo::RecursiveDoubling,
            Algorithm::RecursiveDoubling,
        ),
        (AllReduceAlgo::Rabenseifner, Algorithm::Rabenseifner),
        (AllReduceAlgo::Tree, Algorithm::Tree),
    ] {
        let p = Policy {
            forced,
            ..policy(5, None)
        };
        assert_eq!(p.all_reduce(1 << 20), want, "{forced:?}");
        // Over memory peers a forced algorithm streams over the links (the ring
        // reads the peers' memory).
        let pulled = Policy {
            host_pull: true,
            ..p
        };
        assert_eq!(pulled.all_reduce(1 << 20), want, "{forced:?}");
        assert_eq!(
            pulled.all_reduce_pulls(want, 1 << 20),
            want == Algorithm::Ring
        );
        assert_eq!(pulled.rooted(), Algorithm::Chain);
        assert!(pulled.pull(1 << 20) && !p.pull(1 << 20));
    }
    let tree = Policy {
        forced: AllReduceAlgo::Tree,
        ..policy(5, None)
    };
    assert_eq!(tree.rooted(), Algorithm::Tree);
}

#[test]
fn a_cost_model_chooses_by_predicted_time() {
    // 1 Gbit/s links with 50 µs per message: latency rules small messages,
    // bandwidth large ones.
    let p = Policy {
        model: Some(Model {
            alpha: 50e-6,
            bandwidth: 125e6,
            reduce: 10e9,
            within_host: None,
        }),
        ..policy(16, None)
    };
    let small = p.all_reduce(256);
    assert!(
        matches!(small, Algorithm::RecursiveDoubling | Algorithm::Tree),
        "{small:?}"
    );
    let large = p.all_reduce(256 << 20);
    assert!(
        matches!(large, Algorithm::Ring | Algorithm::Rabenseifner),
        "{large:?}"
    );
}

#[test]
fn link_peers_are_the_neighbours_and_partners_once_each() {
    assert!(link_peers(0, 1, None).is_empty());
    assert_eq!(link_peers(0, 2, None), vec![1]);
    let p = link_peers(3, 8, None);
    assert_eq!(p, vec![1, 2, 4, 7]);
    let l = HostLayout::from_hosts(&["a", "a", "b", "b"]);
    for r in 0..4 {
        let p = link_peers(r, 4, Some(&l));
        assert!(
            !p.contains(&r) && p.windows(2).all(|w| w[0] < w[1]),
            "{p:?}"
        );
        assert!(p.contains(&schedule::left(r, 4)) && p.contains(&schedule::right(r, 4)));
    }
}

#[test]
fn chain_segments_shorten_the_fill_and_stay_in_bounds() {
    let configured = SEG;
    for n in [2usize, 3, 4, 5, 7, 8, 16, 33, 64, 1000] {
        for shift in 10..=28 {
            for len in [1usize << shift, (1 << shift) + 24, 3 << (shift - 2)] {
                // The best segment in bounds under the model.
                let min = schedule::MIN_AUTO_SEGMENT_BYTES;
                let best = (1..=len.div_ceil(min))
                    .map(|k| chain_cost(len, n, len.div_ceil(k).clamp(min, configured)))
                    .fold(f64::INFINITY, f64::min);
                for es in [1usize, 2, 8] {
                    let g = chain_segment(false, len, n, es, configured);
                    assert_eq!(g % es, 0, "n {n} len {len} es {es}: {g}");
                    if n == 2 {
                        assert_eq!(g, configured, "two ranks keep the configured segment");
                        continue;
                    }
                    assert!((min..=configured).contains(&g), "n {n} len {len}: {g}");
                    // Never worse than the configured segment under the model, and
                    // within 3% of the best segment in bounds.
                    let got = chain_cost(len, n, g);
                    assert!(got <= chain_cost(len, n, configured) * (1.0 + 1e-9));
                    assert!(got <= best * 1.03, "n {n} len {len}: {got} vs {best}");
                }
            }
        }
    }
    // The case that was 4x S/B: 1 MiB over 8 ranks in 2 segments of 512 KiB took
    // 8 segment times; now its segment times add up to less than half of that.
    let g = chain_segment(false, 1 << 20, 8, 4, configured);
    let k = (1usize << 20).div_ceil(g);
    assert!(2 * (k + 6) * g < 8 * configured, "{k} segments of {g}");
    // A configured segment below the floor is kept; pulled chains are `n` deep.
    assert_eq!(chain_segment(false, 1 << 20, 8, 4, 4096), 4096);
    assert_eq!(chain_segment(true, 1 << 20, 8, 4, configured), 1 << 17);
}

#[test]
fn device_all_reduce_takes_the_fewest_hand_overs() {
    for n in 2..=16 {
        let m = device_one_shot_max(n);
        assert!(m >= 4 << 10, "n={n}");
        if n > 2 {
            assert!(
                m <= device_one_shot_max(n - 1),
                "n={n}: one-shot grows with n"
            );
        }
        let auto = |b| device_all_reduce(n, b, AllReduceAlgo::Auto);
        for b in [0, 1, 4 << 10, m] {
            assert_eq!(auto(b), Algorithm::OneShot, "n={n} {b}");
        }
        for b in [m + 1, 16 << 20, 1 << 30, usize::MAX] {
            assert_eq!(auto(b), Algorithm::TwoShot, "n={n} {b}");
        }
        for (forced, want) in [
            (AllReduceAlgo::Ring, Algorithm::Ring),
            (AllReduceAlgo::OneShot, Algorithm::OneShot),
            (AllReduceAlgo::TwoShot, Algorithm::TwoShot),
            (AllReduceAlgo::Hierarchical, Algorithm::TwoShot),
            (AllReduceAlgo::RecursiveDoubling, Algorithm::Ring),
            (AllReduceAlgo::Rabenseifner, Algorithm::Ring),
            (AllReduceAlgo::Tree, Algorithm::Ring),
        ] {
            for b in [4, 1 << 20, 1 << 30] {
                assert_eq!(
                    device_all_reduce(n, b, forced),
                    want,
                    "n={n} {forced:?} {b}"
                );
            }
        }
    }
    // One rank has nothing to hand over: the ring's empty plan, whatever is forced.
    for forced in [
        AllReduceAlgo::Auto,
        AllReduceAlgo::OneShot,
        AllReduceAlgo::TwoShot,
    ] {
        assert_eq!(device_all_reduce(1, 1 << 20, forced), Algorithm::Ring);
    }
}

#[test]
fn staged_pieces_cover_the_buffer_once_in_bounded_pieces() {
    for es in [1, 2, 4, 8] {
        for count in [
            0,
            1,
            7,
            (2 << 20) / es,
            (2 << 20) / es + 1,
            (4 << 20) / es + 3,
            (64 << 20) / es,
            (1 << 30) / es + 5,
        ] {
            let p = staged_pieces(count, es);
            assert_eq!(p.first().map(|r| r.start), Some(0), "{count}x{es}");
            assert_eq!(p.last().map(|r| r.end), Some(count), "{count}x{es}");
            assert!(p.windows(2).all(|w| w[0].end == w[1].start), "{count}x{es}");
            if count * es <= 2 << 20 {
                assert_eq!(p.len(), 1, "{count}x{es}: small buffers are one piece");
                continue;
            }
            assert!(
                p.len() >= 2 && p.iter().all(|r| !r.is_empty()),
                "{count}x{es}"
            );
            // Every piece but the last the same size, 1 to 16 MiB.
            let first = p[0].len() * es;
            assert!(
                ((1 << 20)..=16 << 20).contains(&first),
                "{count}x{es}: {first}"
            );
            assert!(p[..p.len() - 1].iter().all(|r| r.len() == p[0].len()));
            assert!(
                p.len() <= 4 || first == 16 << 20,
                "{count}x{es}: {}",
                p.len()
            );
        }
    }
}

#[test]
fn many_ranks_keep_two_shot_up_to_16_mib_on_symmetric_memory() {
    for n in 2..=16 {
        let auto = Policy {
            host_pull: true,
            sym: true,
            pull_max: 1 << 30,
            ..policy(n, None)
        };
        let hi = if n >= 8 { 16 << 20 } else { 4 << 20 };
        assert_eq!(sym_two_shot_max(n), hi, "n={n}");
        assert_eq!(auto.all_reduce(hi), Algorithm::TwoShot, "n={n}");
        assert!(auto.all_reduce_pulls(Algorithm::TwoShot, hi), "n={n}");
        assert_eq!(auto.all_reduce(hi + 1), Algorithm::Ring, "n={n}");
        assert!(!auto.all_reduce_pulls(Algorithm::Ring, hi + 1), "n={n}");
    }
}
