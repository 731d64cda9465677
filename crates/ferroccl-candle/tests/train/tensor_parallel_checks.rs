//! Tensor parallelism's formula and refusals: the bytes each rank's tensor-parallel
//! links counted in a step are the per-block formula's (`cost`, what `ferroccl plan
//! --tensor-parallel` prints), with the ring forced as the ring law's tests do; and
//! misuse — a layout that is not the job, a size T does not divide, shards that
//! disagree between ranks, a tensor rank that dies mid-step — is a typed error on
//! every rank, never a hang; a checkpoint of another tensor shard loads on no rank.

use crate::tensor_parallel::{batch, build, sgd, BATCH, DEADLINE, FFN, HEADS, HIDDEN, SEQ};
use crate::{run, run_all};
use candle_core::{Device, Module, Tensor, Var};
use ferroccl::testing::{all_errors, test_config, Net};
use ferroccl::AllReduceAlgo;
use ferroccl_candle::pipeline::{Layout, Pipeline, PipelineConfig};
use ferroccl_candle::tensor_parallel::cost::{
    block_all_reduces, bytes_per_rank, mlp_stage_all_reduces, plan, PlanInput,
};
use ferroccl_candle::tensor_parallel::{Mesh, TensorGroup, TpMlp, TpSelfAttention};
use ferroccl_candle::trainer::mlp::tp_mlp_stage;
use ferroccl_candle::{Error, Result};

fn mesh(pipeline: usize, tensor: usize, data: usize) -> Mesh {
    Mesh {
        pipeline,
        tensor,
        data,
    }
}

/// Payload bytes `group` sent while `f` ran (a forward and a backward).
fn counted(group: &TensorGroup, f: impl FnOnce() -> Result<()>) -> Result<(u64, u64)> {
    let before = group.wire_stats();
    f()?;
    let d = group.wire_stats().since(&before);
    Ok((d.payload_sent, d.payload_recv))
}

/// Forward `x` through `m`, a loss (cross-entropy, or the sum of squares for a
/// block), backward.
fn step(m: &dyn Module, x: &Tensor, labels: Option<&Tensor>) -> Result<()> {
    let out = m.forward(x)?;
    let loss = match labels {
        Some(y) => candle_nn::loss::cross_entropy(&out, y),
        None => out.sqr().and_then(|o| o.sum_all()),
    }?;
    loss.backward()?;
    Ok(())
}

#[test]
fn the_bytes_the_links_counted_are_the_per_block_formulas() {
    for t in [2usize, 4] {
        let mut cfg = test_config();
        cfg.tuning.all_reduce_algo = AllReduceAlgo::Ring;
        let out = run(t, Net::Local, &cfg, DEADLINE, move |c| {
            let l = Layout::mesh(c, mesh(1, t, 1))?;
            let g = &l.tensor;
            // The transformer layer (attention, MLP) fed an earlier stage's activation,
            // which needs its gradient; then fed the data, which does not.
            let (model, _) = build(g, 0, 1)?;
            let (x, y) = batch(0, 0..BATCH);
            let v = Var::from_tensor(&x)?;
            let fed = counted(g, || step(&model, v.as_tensor(), Some(&y)))?;
            let data = counted(g, || step(&model, &x, Some(&y)))?;
            // The trainer's MLP as stage 0 (2 blocks, the data in) and as a later
            // stage (1 block, an activation in).
            let w = [6, 8, 8, 8, 3];
            let (first, _) = tp_mlp_stage(&w, 0..4, 1, g, &Device::Cpu)?;
            let (later, _) = tp_mlp_stage(&w, 2..4, 1, g, &Device::Cpu)?;
            let xs = Tensor::ones((8, 6), candle_core::DType::F32, &Device::Cpu)?;
            let hv = Var::ones((8, 8), candle_core::DType::F32, &Device::Cpu)?;
            let s0 = counted(g, || step(&first, &xs, None))?;
            let s1 = counted(g, || step(&later, hv.as_tensor(), None))?;
            Ok([fed, data, s0, s1])
        })
        .expect("count");
        let rows = BATCH * SEQ;
        let layer = |input_grad| {
            let mut a = block_all_reduces(rows, HIDDEN, HIDDEN, input_grad);
            a.extend(block_all_reduces(rows, HIDDEN, HIDDEN, true));
            bytes_per_rank(&a, 4, t)
        };
        let w = [6, 8, 8, 8, 3];
        let law = [
            layer(true),
            layer(false),
            bytes_per_rank(&mlp_stage_all_reduces(&w, 0..4, 8).unwrap(), 4, t),
            bytes_per_rank(&mlp_stage_all_reduces(&w, 2..4, 8).unwrap(), 4, t),
        ];
        // What `ferroccl plan --tensor-parallel` prints for this layer.
        let p = plan(PlanInput {
            tensor: t,
            batch: BATCH,
            seq: SEQ,
            hidden: HIDDEN,
            ffn: FFN,
            layers: 1,
            attention: true,
            elem_bytes: 4,
        })
        .unwrap();
        assert_eq!(p.bytes_per_step, law[0]);
        assert_eq!(
            p.bytes_per_all_reduce,
            2.0 * (t - 1) as f64 / t as f64 * (BATCH * SEQ * HIDDEN * 4) as f64
        );
        for (r, got) in out.iter().enumerate() {
            for (k, ((sent, recv), want)) in got.iter().zip(law).enumerate() {
                assert!(want > 0.0);
                assert_eq!(*sent as f64, want, "T={t} rank {r} case {k}: sent");
                assert_eq!(*recv as f64, want, "T={t} rank {r} case {k}: received");
            }
        }
    }
}

#[test]
fn a_layout_that_is_not_the_job_is_refused_on_every_rank() {
    let errs = all_errors(
        run_all(3, Net::Local, &test_config(), DEADLINE, |c| {
            Layout::mesh(c, mesh(2, 2, 1)).map(|_| ())
        }),
        "2 × 2 × 1 on 3 ranks",
    );
    for e in errs {
        assert!(
            matches!(&e, Error::Comm(ferroccl::Error::InvalidArgument(w)) if w.contains("is 4 ranks, not the job's 3")),
            "{e}"
        );
    }
    // Rank 1 asks for another layout of the same size: every rank names a mismatch.
    let errs = all_errors(
        run_all(4, Net::Local, &test_config(), DEADLINE, |c| {
            let m = if c.rank() == 1 {
                mesh(1, 2, 2)
            } else {
                mesh(2, 2, 1)
            };
            Layout::mesh(c, m).map(|_| ())
        }),
        "layouts that disagree",
    );
    for (r, e) in errs.iter().enumerate() {
        match e {
            Error::Comm(ferroccl::Error::Mismatch { peer, theirs, .. }) => {
                assert_eq!(*peer, if r == 1 { 0 } else { 1 }, "rank {r}");
                assert!(theirs.contains("layout"), "{theirs}");
            }
            e => panic!("rank {r}: {e}"),
        }
    }
}

fn tensors(shapes: &[&[usize]]) -> Vec<Tensor> {
    shapes
        .iter()
        .map(|s| Tensor::ones(*s, candle_core::DType::F32, &Device::Cpu).unwrap())
        .collect()
}

#[test]
fn a_size_t_does_not_divide_is_refused_on_every_rank() {
    // An MLP of hidden size 6 over 4 ranks.
    let errs = all_errors(
        run_all(4, Net::Local, &test_config(), DEADLINE, |c| {
            let g = Layout::mesh(c, mesh(1, 4, 1))?.tensor;
            let w = tensors(&[&[6, HIDDEN], &[6], &[HIDDEN, 6], &[HIDDEN]]);
            TpMlp::from_whole(&g, (&w[0], Some(&w[1])), Tensor::tanh, (&w[2], Some(&w[3])))
                .map(|_| ())
        }),
        "hidden 6 over T = 4",
    );
    for e in errs {
        assert!(
            matches!(&e, Error::Comm(ferroccl::Error::InvalidArgument(w)) if w.contains("of 6 does not cut") && w.contains("T = 4")),
            "{e}"
        );
    }
    // Two heads over 4 ranks.
    let errs = all_errors(
        run_all(4, Net::Local, &test_config(), DEADLINE, |c| {
            let g = Layout::mesh(c, mesh(1, 4, 1))?.tensor;
            let h = HIDDEN;
            let w = tensors(&[&[3 * h, h], &[3 * h], &[h, h], &[h]]);
            TpSelfAttention::from_whole(&g, 2, (&w[0], Some(&w[1])), (&w[2], Some(&w[3])))
                .map(|_| ())
        }),
        "2 heads over T = 4",
    );
    for e in errs {
        assert!(
            matches!(&e, Error::Comm(ferroccl::Error::InvalidArgument(w)) if w.contains("head count of 2")),
            "{e}"
        );
    }
}

#[test]
fn shards_that_disagree_between_ranks_are_a_mismatch_on_every_rank() {
    let errs = all_errors(
        run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
            let g = Layout::mesh(c, mesh(1, 2, 1))?.tensor;
            // Rank 1 builds its MLP 32 wide, rank 0 16.
            let f = if c.rank() == 1 { 32 } else { FFN };
            let w = tensors(&[&[f, HIDDEN], &[f], &[HIDDEN, f], &[HIDDEN]]);
            TpMlp::from_whole(&g, (&w[0], Some(&w[1])), Tensor::tanh, (&w[2], Some(&w[3])))
                .map(|_| ())
        }),
        "16 against 32",
    );
    for (r, e) in errs.iter().enumerate() {
        match e {
            Error::Comm(ferroccl::Error::Mismatch {
                peer, ours, theirs, ..
            }) => {
                assert_eq!(*peer, 1 - r);
                let (mine, other) = if r == 0 { ("16", "32") } else { ("32", "16") };
                assert!(
                    ours.contains(mine) && theirs.contains(other),
                    "{ours} / {theirs}"
                );
            }
            e => panic!("rank {r}: {e}"),
        }
    }
    // A weight that is not a matrix on one rank: that rank's own error, a mismatch
    // (it declared nothing) on the other, and no hang.
    let errs = all_errors(
        run_all(2, Net::Local, &test_config(), DEADLINE, |c| {
            let g = Layout::mesh(c, mesh(1, 2, 1))?.tensor;
            let up: &[usize] = if c.rank() == 0 {
                &[FFN, HIDDEN, 1]
            } else {
                &[FFN, HIDDEN]
            };
            let w = tensors(&[up, &[FFN], &[HIDDEN, FFN], &[HIDDEN]]);
            TpMlp::from_whole(&g, (&w[0], Some(&w[1])), Tensor::tanh, (&w[2], Some(&w[3])))
                .map(|_| ())
        }),
        "a 3-D weight",
    );
    assert!(
        matches!(&errs[0], Error::Comm(ferroccl::Error::InvalidArgument(w)) if w.contains("(out, in)")),
        "{}",
        errs[0]
    );
    assert!(
        matches!(&errs[1], Error::Comm(ferroccl::Error::Mismatch { theirs, .. }) if theirs.contains("declared no layer")),
        "{}",
        errs[1]
    );
}

#[test]
fn a_tensor_rank_that_dies_mid_step_fails_every_rank_with_a_typed_error() {
    let out = run_all(4, Net::Local, &test_config(), DEADLINE, |c| {
        let l = Layout::mesh(c, mesh(2, 2, 1))?;
        let (s, p) = (l.pipe.rank(), l.pipe.world_size());
        let (model, shards) = build(&l.tensor, s, p)?;
        let vars = shards
            .iter()
            .map(|s| (s.name.clone(), s.var.clone()))
            .collect();
        let cfg = PipelineConfig {
            micro_batches: 2,
            ..PipelineConfig::default()
        };
        let mut pl = Pipeline::from_vars(&l.pipe, None, model, vars, &[SEQ, HIDDEN], sgd(), cfg)?
            .with_tensor_group(&l.tensor);
        for step in 0..3 {
            if c.rank() == 3 && step == 2 {
                // Tensor rank 1 of stage 1 dies: its links go with it.
                l.tensor.abort();
                l.pipe.abort_handle().abort();
                return Err(Error::invalid("rank 3 died"));
            }
            let (x, _) = batch(step, 0..BATCH);
            let loss = move |out: &Tensor, r: std::ops::Range<usize>| {
                candle_nn::loss::cross_entropy(out, &batch(step, r).1)
            };
            pl.step(BATCH, (s == 0).then_some(&x), &loss, 0.05)?;
        }
        Ok(())
    });
    let errs = all_errors(out, "a dead tensor rank");
    // Its tensor peer was in a collective with it: that collective's own error (not
    // candle's message), naming the dead rank; the other stage's ranks lose their
    // pipeline peers in turn, and nobody waits for the timeout.
    assert!(
        matches!(&errs[2], Error::Comm(e) if !matches!(e, ferroccl::Error::InvalidArgument(_)))
            && errs[2].to_string().contains("job rank 3"),
        "rank 2: {}",
        errs[2]
    );
    for r in [0, 1] {
        assert!(
            matches!(
                errs[r],
                Error::Comm(ferroccl::Error::PeerClosed { .. })
                    | Error::Comm(ferroccl::Error::Poisoned(_))
                    | Error::Comm(ferroccl::Error::PeerFailed { .. })
            ),
            "rank {r}: {}",
            errs[r]
        );
    }
    let _ = HEADS;
}

#[test]
fn a_checkpoint_loads_on_every_tensor_rank_or_on_none() {
    let dir = std::env::temp_dir().join(format!("ferroccl-candle-tp-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let d2 = dir.clone();
    let out = run(2, Net::Local, &test_config(), DEADLINE, move |c| {
        let l = Layout::mesh(c, mesh(1, 2, 1))?;
        let t = l.tensor.rank();
        let (model, shards) = build(&l.tensor, 0, 1)?;
        let vars = shards
            .iter()
            .map(|s| (s.name.clone(), s.var.clone()))
            .collect();
        let cfg = PipelineConfig::default();
        let mut pl = Pipeline::from_vars(&l.pipe, None, model, vars, &[SEQ, HIDDEN], sgd(), cfg)?
            .with_tensor_group(&l.tensor);
        let ck = pl
            .snapshot(serde_json::json!({}))?
            .expect("each tensor rank writes");
        ferroccl::ddp::checkpoint::save(&d2.join(format!("t{t}.ckpt")), &ck)?;
        l.tensor.with(|c| c.barrier())?;
        let before = pl.weights();
        // Tensor rank 0 is offered its own file, rank 1 rank 0's (another shard).
        let file = d2.join("t0.ckpt");
        let r = pl.restore(ferroccl::ddp::checkpoint::load(&file).map(|ck| Some((file, ck))));
        Ok((r.map(|_| ()), before == pl.weights()))
    })
    .expect("2 tensor ranks");
    match &out[1].0 {
        Err(Error::Train(ferroccl::ddp::TrainError::Checkpoint { why, .. })) => {
            assert!(why.contains("\"tensor\":0"), "{why}")
        }
        other => panic!("tensor rank 1: {other:?}"),
    }
    match &out[0].0 {
        Err(Error::Comm(ferroccl::Error::InvalidArgument(w))) => {
            assert!(w.contains("tensor-parallel rank"), "{w}")
        }
        other => panic!("tensor rank 0: {other:?}"),
    }
    assert!(
        out[0].1 && out[1].1,
        "a half-restored tensor-parallel model"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
