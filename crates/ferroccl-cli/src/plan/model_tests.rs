//! Tests of the plan's arithmetic (model.rs), parsing (parse.rs) and report (render.rs).

use super::*;

/// |got − want| ≤ 1e-12 × |want| (or 1e-15 absolute near zero).
#[track_caller]
fn close(got: impl Into<Option<f64>>, want: f64) {
    let got = got.into().expect("computed, not skipped");
    let tol = 1e-12 * want.abs().max(1e-3);
    assert!(
        (got - want).abs() <= tol,
        "got {got}, want {want} (diff {})",
        got - want
    );
}

/// Case A: ResNet-50-ish on ImageNet, 8 ranks on a 10 Gbit/s link, no overlap.
fn case_a() -> PlanInput {
    PlanInput {
        ranks: Some(8),
        per_rank_batch: Some(32),
        accumulation_steps: 1,
        dataset_size: Some(1_281_167),
        epochs: 90,
        compute: Some(Compute::Throughput(400.0)),
        amp_speedup: 1.0,
        base_lr: Some(0.1),
        base_batch: Some(256),
        warmup: Some(Warmup::Epochs(5.0)),
        gradient: Some(Gradient::Params(25_600_000)),
        grad_dtype: GradDtype::F32,
        link: Some(Link::from_bandwidth(1.25e9, 0.0, "10Gbit")),
        overlap: 0.0,
        overhead: Some(0.0),
        comm_s: None,
        comm_cut: None,
    }
}

#[test]
fn case_a_by_hand() {
    let p = compute(&case_a()).expect("valid");
    // global batch = 8 × 32 × 1 = 256
    assert_eq!(p.global_batch, Some(256));
    // steps per epoch = floor(1281167 / 256) = 5004 (5004 × 256 = 1281024, 143 left)
    assert_eq!(p.steps_per_epoch, Some(5004));
    assert_eq!(p.dropped_samples_per_epoch, Some(143));
    // total steps = 5004 × 90 = 450360
    assert_eq!(p.total_steps, Some(450_360));
    // lr = 0.1 × 256 / 256 = 0.1; warmup = ceil(5 × 5004) = 25020
    close(p.scaled_lr.expect("lr"), 0.1);
    assert_eq!(p.warmup_steps, Some(25_020));
    close(p.warmup_epochs, 5.0);
    // compute = 32 × 1 / 400 / 1 = 0.08 s
    close(p.compute_s, 0.08);
    close(p.baseline_throughput, 400.0);
    // S = 25.6e6 × 4 = 102.4e6 B; ring bytes = 2 × 7/8 × 102.4e6 = 179.2e6 B
    close(p.grad_bytes, 102.4e6);
    close(p.ring_bytes_per_rank, 179.2e6);
    // β = 1 / 1.25e9 = 0.8 ns/B; comm = 14 × 0 + 179.2e6 × 0.8e-9 = 0.14336 s
    close(p.beta_s_per_byte, 0.8e-9);
    close(p.link_bytes_per_s, 1.25e9);
    close(p.comm_s, 0.14336);
    close(p.comm_f32_s, 0.14336);
    // f16 halves it: 89.6e6 × 0.8e-9 = 0.07168 s
    close(p.comm_f16_s, 0.07168);
    // no overlap: visible = comm; step = 0.08 + 0.14336 = 0.22336 s
    close(p.hidden_comm_s, 0.0);
    close(p.visible_comm_s, 0.14336);
    close(p.step_s, 0.22336);
    // share = 0.14336 / 0.22336 = 0.6418338...
    close(p.comm_share, 0.14336 / 0.22336);
    // throughput = 256 / 0.22336 = 1146.1318... samples/s
    close(p.throughput, 256.0 / 0.22336);
    // speedup = 1146.13 / 400 = 2.86533; efficiency = 0.08 / 0.22336 = 0.358166
    close(p.speedup, 256.0 / 0.22336 / 400.0);
    close(p.efficiency, 0.08 / 0.22336);
    // epoch = 5004 × 0.22336 = 1117.69344 s; total = 90 × that = 100592.4096 s
    close(p.epoch_s, 1117.69344);
    close(p.total_s, 100592.4096);
}

/// Case B: accumulation, AMP, bf16 gradients, α, partial overlap and an overhead.
#[test]
fn case_b_by_hand() {
    let input = PlanInput {
        ranks: Some(4),
        per_rank_batch: Some(64),
        accumulation_steps: 2,
        dataset_size: Some(100_000),
        epochs: 3,
        compute: Some(Compute::Throughput(1000.0)),
        amp_speedup: 2.0,
        base_lr: Some(0.1),
        base_batch: Some(256),
        warmup: Some(Warmup::Steps(100)),
        gradient: Some(Gradient::Params(10_000_000)),
        grad_dtype: GradDtype::BF16,
        // 100 Gbit/s = 12.5e9 B/s; α = 10 µs
        link: Some(Link::from_bandwidth(12.5e9, 10e-6, "100Gbit")),
        overlap: 0.75,
        overhead: Some(0.1),
        comm_s: None,
        comm_cut: None,
    };
    let p = compute(&input).expect("valid");
    // G = 4 × 64 × 2 = 512; steps = floor(100000 / 512) = 195 (99840, 160 left); 585 in all
    assert_eq!(p.global_batch, Some(512));
    assert_eq!(p.steps_per_epoch, Some(195));
    assert_eq!(p.dropped_samples_per_epoch, Some(160));
    assert_eq!(p.total_steps, Some(585));
    // lr = 0.1 × 512 / 256 = 0.2; warmup given: 100 steps = 100/195 epochs
    close(p.scaled_lr.expect("lr"), 0.2);
    assert_eq!(p.warmup_steps, Some(100));
    close(p.warmup_epochs, 100.0 / 195.0);
    // compute = 64 × 2 / 1000 / 2 = 0.064 s; baseline = 128 / 0.064 = 2000 samples/s
    close(p.compute_s, 0.064);
    close(p.baseline_throughput, 2000.0);
    // S = 10e6 × 2 = 20e6 B; ring = 2 × 3/4 × 20e6 = 30e6 B
    close(p.grad_bytes, 20e6);
    close(p.ring_bytes_per_rank, 30e6);
    // comm = 2·3·10e-6 + 30e6 / 12.5e9 = 60e-6 + 2.4e-3 = 2.46e-3 s
    close(p.comm_s, 2.46e-3);
    close(p.comm_f16_s, 2.46e-3);
    // f32: 60e-6 + 60e6 / 12.5e9 = 60e-6 + 4.8e-3 = 4.86e-3 s
    close(p.comm_f32_s, 4.86e-3);
    // hidden = min(0.75 × 2.46e-3, 0.064) = 1.845e-3; visible = 0.615e-3
    close(p.hidden_comm_s, 1.845e-3);
    close(p.visible_comm_s, 0.615e-3);
    // step = (0.064 + 0.000615) / 0.9 = 0.071794444... s
    close(p.step_s, 0.064615 / 0.9);
    // throughput = 512 / 0.0717944 = 460.8 / 0.064615 = 7131.47 samples/s
    close(p.throughput, 460.8 / 0.064615);
    // speedup = 7131.47 / 2000 = 3.56574; efficiency = 0.891434
    close(p.speedup, 460.8 / 0.064615 / 2000.0);
    close(p.efficiency, 460.8 / 0.064615 / 8000.0);
    // share = 0.000615 / 0.0717944 = 0.0085661
    close(p.comm_share, 0.000615 * 0.9 / 0.064615);
    // epoch = 195 × 0.0717944 = 13.99992 s; total = 3 × that = 41.99975 s
    close(p.epoch_s, 195.0 * 0.064615 / 0.9);
    close(p.total_s, 585.0 * 0.064615 / 0.9);
}

/// Case C: overlap cannot hide more communication than there is compute.
#[test]
fn case_c_overlap_capped_by_compute() {
    let input = PlanInput {
        ranks: Some(2),
        per_rank_batch: Some(16),
        accumulation_steps: 1,
        dataset_size: Some(3200),
        epochs: 2,
        compute: Some(Compute::StepTimeS(0.010)),
        amp_speedup: 1.0,
        base_lr: None,
        base_batch: None,
        warmup: None,
        gradient: Some(Gradient::Params(100_000_000)),
        grad_dtype: GradDtype::F32,
        link: Some(Link::from_bandwidth(1.25e9, 0.0, "1.25GB")),
        overlap: 0.5,
        overhead: Some(0.0),
        comm_s: None,
        comm_cut: None,
    };
    let p = compute(&input).expect("valid");
    // G = 32; steps = 3200 / 32 = 100, nothing dropped; 200 in all
    assert_eq!(
        (p.global_batch, p.steps_per_epoch, p.total_steps),
        (Some(32), Some(100), Some(200))
    );
    assert_eq!(p.dropped_samples_per_epoch, Some(0));
    assert_eq!(p.scaled_lr, None);
    assert_eq!(p.warmup_steps, Some(0));
    // single rank: 16 / 0.01 = 1600 samples/s
    close(p.single_rank_throughput, 1600.0);
    // S = 400e6 B; ring = 2 × 1/2 × 400e6 = 400e6 B; comm = 400e6 / 1.25e9 = 0.32 s
    close(p.ring_bytes_per_rank, 400e6);
    close(p.comm_s, 0.32);
    close(p.comm_f16_s, 0.16);
    // hidden = min(0.5 × 0.32, 0.01) = 0.01 (not 0.16); visible = 0.31; step = 0.32
    close(p.hidden_comm_s, 0.01);
    close(p.visible_comm_s, 0.31);
    close(p.step_s, 0.32);
    // throughput = 32 / 0.32 = 100; speedup = 100 / 1600 = 0.0625; efficiency 0.03125
    close(p.throughput, 100.0);
    close(p.speedup, 0.0625);
    close(p.efficiency, 0.03125);
    close(p.comm_share, 0.31 / 0.32);
    // epoch = 100 × 0.32 = 32 s; total = 64 s
    close(p.epoch_s, 32.0);
    close(p.total_s, 64.0);
}

/// Case D: gradient bytes given in f16, odd world size, full overlap, AMP on a given
/// compute time, fractional warmup epochs.
#[test]
fn case_d_full_overlap_odd_ranks() {
    let input = PlanInput {
        ranks: Some(3),
        per_rank_batch: Some(10),
        accumulation_steps: 4,
        dataset_size: Some(1000),
        epochs: 2,
        compute: Some(Compute::StepTimeS(0.2)),
        amp_speedup: 1.6,
        base_lr: Some(0.4),
        base_batch: Some(480),
        warmup: Some(Warmup::Epochs(0.5)),
        gradient: Some(Gradient::Bytes(30_000_000)),
        grad_dtype: GradDtype::F16,
        // 8 Gbit/s = 1e9 B/s, α = 100 µs
        link: Some(Link::from_bandwidth(1e9, 100e-6, "8Gbit")),
        overlap: 1.0,
        overhead: Some(0.0),
        comm_s: None,
        comm_cut: None,
    };
    let p = compute(&input).expect("valid");
    // G = 3 × 10 × 4 = 120; steps = floor(1000 / 120) = 8 (960, 40 left); 16 in all
    assert_eq!(
        (
            p.global_batch,
            p.steps_per_epoch,
            p.dropped_samples_per_epoch
        ),
        (Some(120), Some(8), Some(40))
    );
    // lr = 0.4 × 120 / 480 = 0.1; warmup = ceil(0.5 × 8) = 4
    close(p.scaled_lr.expect("lr"), 0.1);
    assert_eq!(p.warmup_steps, Some(4));
    // single rank = 40 / 0.2 = 200; compute = 0.2 / 1.6 = 0.125 s; baseline 320
    close(p.single_rank_throughput, 200.0);
    close(p.compute_s, 0.125);
    close(p.baseline_throughput, 320.0);
    // params = 30e6 / 2 = 15e6; ring = 2 × 2/3 × 30e6 = 40e6 B
    close(p.params, 15e6);
    close(p.ring_bytes_per_rank, 40e6);
    // comm = 2·2·100e-6 + 40e6 × 1e-9 = 0.0004 + 0.04 = 0.0404 s
    close(p.comm_s, 0.0404);
    // f32: 0.0004 + 2 × 2/3 × 60e6 × 1e-9 = 0.0804 s
    close(p.comm_f32_s, 0.0804);
    // all of it hidden (0.0404 < 0.125): step = compute = 0.125 s
    close(p.visible_comm_s, 0.0);
    close(p.step_s, 0.125);
    // throughput = 120 / 0.125 = 960; speedup = 960 / 320 = 3 = N; efficiency 1
    close(p.throughput, 960.0);
    close(p.speedup, 3.0);
    close(p.efficiency, 1.0);
    close(p.comm_share, 0.0);
    // epoch = 8 × 0.125 = 1 s; total 2 s
    close(p.epoch_s, 1.0);
    close(p.total_s, 2.0);
}

#[test]
fn one_rank_has_no_communication() {
    let mut i = case_a();
    i.ranks = Some(1);
    i.dataset_size = Some(1000);
    i.epochs = 1;
    i.warmup = None;
    i.link = Some(Link::from_bandwidth(1.25e9, 50e-6, "10Gbit")); // even with latency: a ring of one takes no steps
    i.overlap = 0.5;
    let p = compute(&i).expect("valid");
    // G = 32; floor(1000 / 32) = 31, 8 left
    assert_eq!((p.global_batch, p.steps_per_epoch), (Some(32), Some(31)));
    assert_eq!(p.dropped_samples_per_epoch, Some(8));
    assert_eq!(p.ring_bytes_per_rank, Some(0.0));
    assert_eq!(
        (p.comm_s, p.comm_f32_s, p.comm_f16_s),
        (Some(0.0), Some(0.0), Some(0.0))
    );
    assert_eq!(p.visible_comm_s, Some(0.0));
    close(p.step_s, 0.08);
    close(p.throughput, 400.0);
    close(p.speedup, 1.0);
    close(p.efficiency, 1.0);
    assert_eq!(p.comm_share, Some(0.0));
    // lr = 0.1 × 32 / 256 = 0.0125
    close(p.scaled_lr.expect("lr"), 0.0125);
}

/// The question as people pose it: "one GPU does 150 img/s at batch 128; on 8 GPUs
/// with +25 % from mixed precision and about 15 % lost to communication, what global
/// batch, steps per epoch, throughput, epoch time and learning rate?" No link, no
/// gradient size: --overhead 0.15 is the lump lost to communication and the rest.
fn question_one() -> PlanInput {
    PlanInput {
        ranks: Some(8),
        per_rank_batch: Some(128),
        accumulation_steps: 1,
        dataset_size: None,
        epochs: 1,
        compute: Some(Compute::Throughput(150.0)),
        amp_speedup: 1.25,
        base_lr: None,
        base_batch: None,
        warmup: None,
        gradient: None,
        grad_dtype: GradDtype::F32,
        link: None,
        comm_s: None,
        comm_cut: None,
        overlap: 0.0,
        overhead: Some(0.15),
    }
}

#[test]
fn question_one_by_hand() {
    let p = compute(&question_one()).expect("answers without a link");
    // global batch = 8 × 128 = 1024
    assert_eq!(p.global_batch, Some(1024));
    // one GPU: 150 img/s; AMP: 150 × 1.25 = 187.5 img/s, so a step of 128 takes
    // 128 / 187.5 = 0.682667 s of compute
    close(p.compute_s, 128.0 / 187.5);
    close(p.baseline_throughput, 187.5);
    // 15 % of each step lost: step = 0.682667 / 0.85 = 0.803137 s
    close(p.step_s, 128.0 / 187.5 / 0.85);
    // throughput = 150 × 8 × 1.25 × (1 − 0.15) = 1275 img/s (= 1024 / 0.803137)
    close(p.throughput, 1275.0);
    // speedup 1275 / 187.5 = 6.8 over one AMP GPU: 85 % efficiency
    close(p.speedup, 6.8);
    close(p.efficiency, 0.85);
    // learning rate, linear scaling from the single GPU's batch: 1024 / 128 = 8 × its lr
    close(p.lr_factor, 8.0);
    assert_eq!(p.scaled_lr, None);
    assert_eq!(p.skipped["scaled_lr"], "needs --base-lr");
    // no dataset size: steps and epoch time are skipped, saying so
    assert_eq!(p.steps_per_epoch, None);
    assert_eq!(p.epoch_s, None);
    assert_eq!(p.skipped["steps_per_epoch"], "needs --dataset-size");
    assert_eq!(p.skipped["epoch_s"], "needs --dataset-size");
    // communication itself is not modelled: it is inside the 15 %
    assert_eq!(p.comm_s, None);
    assert_eq!(p.comm_share, None);
    assert!(p.skipped["comm_s"].contains("--link"));

    // With ImageNet's 1,281,167 images and lr 0.1 for batch 256 (Goyal et al.):
    // steps = floor(1281167 / 1024) = 1251 (143 left over); epoch = 1251 × 0.803137
    // = 1004.72 s = 1281024 / 1275; lr = 0.1 × 1024 / 256 = 0.4
    let mut i = question_one();
    i.dataset_size = Some(1_281_167);
    i.base_lr = Some(0.1);
    i.base_batch = Some(256);
    let p = compute(&i).expect("valid");
    assert_eq!(p.steps_per_epoch, Some(1251));
    assert_eq!(p.dropped_samples_per_epoch, Some(143));
    close(p.epoch_s, 1251.0 * 1024.0 / 1275.0);
    close(p.lr_factor, 4.0);
    close(p.scaled_lr, 0.4);
    // With only the base lr (tuned on the one GPU at 128): 8 × 0.1 = 0.8
    i.base_batch = None;
    close(compute(&i).expect("valid").scaled_lr, 0.8);

    // Without the 15 % (and no link): no communication figure, so no step time
    // rather than a silent perfect scaling; what needs no step time is still there.
    i.overhead = None;
    let p = compute(&i).expect("valid");
    assert_eq!(p.step_s, None);
    assert_eq!(p.throughput, None);
    assert!(
        p.skipped["step_s"].contains("--overhead"),
        "{}",
        p.skipped["step_s"]
    );
    assert_eq!(p.global_batch, Some(1024));
    close(p.compute_s, 128.0 / 187.5);
}

/// "Communication is 90 ms of a 400 ms step; if fp16 halves it and overlap hides
/// 40 % of the rest, what is left visible and what is the step time?" The 90 ms are
/// in the 400 ms and none of them hidden, so compute is 400 − 90 = 310 ms.
#[test]
fn question_two_by_hand() {
    let i = PlanInput {
        ranks: None,
        per_rank_batch: None,
        dataset_size: None,
        compute: Some(Compute::MeasuredStepS(0.400)),
        gradient: None,
        link: None,
        comm_s: Some(0.090),
        comm_cut: Some(2.0),
        overlap: 0.4,
        overhead: None,
        amp_speedup: 1.0,
        ..question_one()
    };
    let p = compute(&i).expect("answers without ranks or a link");
    // compute = 400 − 90 = 310 ms
    close(p.compute_s, 0.310);
    // fp16 halves it: 90 / 2 = 45 ms
    close(p.comm_s, 0.045);
    // overlap hides 40 % of that: 18 ms; visible 45 − 18 = 27 ms (= 90 × 0.5 × 0.6)
    close(p.hidden_comm_s, 0.018);
    close(p.visible_comm_s, 0.027);
    // step = 310 + 27 = 337 ms
    close(p.step_s, 0.337);
    close(p.comm_share, 27.0 / 337.0);
    // nothing needing ranks or a batch is made up
    assert_eq!(p.throughput, None);
    assert_eq!(p.skipped["throughput"], "needs --ranks");
    assert_eq!(p.comm_f32_s, None);
    assert_eq!(p.skipped["comm_f32_s"], "communication given by --comm-ms");
    // --step-ms alone cannot be split into compute and communication
    let p = compute(&PlanInput { comm_s: None, ..i }).expect("valid");
    assert_eq!(p.compute_s, None);
    assert!(p.skipped["compute_s"].contains("--comm-ms"));
}

#[test]
fn nothing_given_skips_everything_with_a_reason() {
    let i = PlanInput {
        ranks: None,
        per_rank_batch: None,
        compute: None,
        overhead: None,
        ..question_one()
    };
    let p = compute(&i).expect("an empty plan is not an error");
    let v: serde_json::Value = serde_json::from_str(&p.to_json().expect("json")).expect("parses");
    let outputs = v.as_object().expect("object");
    let mut nulls = 0;
    for (k, x) in outputs {
        if x.is_null() {
            nulls += 1;
            let why = &p.skipped[k.as_str()];
            assert!(
                why.starts_with("needs ") && !why.contains('\n'),
                "{k}: {why}"
            );
        }
    }
    // every output but the warmup (0 steps: none asked for)
    assert_eq!(nulls, 28, "{v}");
    assert_eq!(p.warmup_steps, Some(0));
    let text = p.render();
    assert!(text.contains("step time                  skipped: needs --throughput"));
}

#[track_caller]
fn rejects(i: PlanInput, needles: &[&str]) {
    match compute(&i) {
        Err(Error::InvalidArgument(m)) => {
            for n in needles {
                assert!(m.contains(n), "{m:?} should mention {n:?}");
            }
        }
        other => panic!("expected InvalidArgument mentioning {needles:?}, got {other:?}"),
    }
}

#[test]
fn bad_inputs_are_named() {
    let with = |f: &dyn Fn(&mut PlanInput)| {
        let mut i = case_a();
        f(&mut i);
        i
    };
    rejects(with(&|i| i.ranks = Some(0)), &["--ranks", "0"]);
    rejects(
        with(&|i| i.per_rank_batch = Some(0)),
        &["--per-rank-batch", "0"],
    );
    rejects(
        with(&|i| i.accumulation_steps = 0),
        &["--accumulation-steps", "0"],
    );
    rejects(
        with(&|i| i.dataset_size = Some(0)),
        &["--dataset-size", "0"],
    );
    rejects(
        with(&|i| i.dataset_size = Some(255)),
        &["--dataset-size", "255", "256"],
    );
    rejects(with(&|i| i.epochs = 0), &["--epochs", "0"]);
    rejects(
        with(&|i| i.compute = Some(Compute::Throughput(0.0))),
        &["--throughput", "0"],
    );
    rejects(
        with(&|i| i.compute = Some(Compute::Throughput(-5.0))),
        &["--throughput", "-5"],
    );
    rejects(
        with(&|i| i.compute = Some(Compute::Throughput(f64::NAN))),
        &["--throughput", "NaN"],
    );
    rejects(
        with(&|i| i.compute = Some(Compute::StepTimeS(0.0))),
        &["--compute-ms"],
    );
    rejects(with(&|i| i.amp_speedup = 0.0), &["--amp-speedup", "0"]);
    rejects(
        with(&|i| i.overlap = -0.1),
        &["--overlap", "-0.1", "[0, 1]"],
    );
    rejects(with(&|i| i.overlap = 1.5), &["--overlap", "1.5"]);
    rejects(
        with(&|i| i.overhead = Some(1.0)),
        &["--overhead", "1", "[0, 1)"],
    );
    rejects(with(&|i| i.overhead = Some(-0.2)), &["--overhead", "-0.2"]);
    rejects(
        with(&|i| i.link = Some(Link::from_bandwidth(0.0, 0.0, "--link 0Gbit"))),
        &["β", "--link 0Gbit"],
    );
    rejects(
        with(&|i| i.link = Some(Link::from_bandwidth(-1.0, 0.0, "--link -1GB"))),
        &["β", "--link -1GB"],
    );
    rejects(
        with(&|i| i.link = Some(Link::from_bandwidth(1e9, -1e-6, "x"))),
        &["--alpha-us"],
    );
    rejects(
        with(&|i| i.comm_s = Some(0.09)),
        &["--comm-ms", "10Gbit", "give one"],
    );
    rejects(
        with(&|i| {
            i.link = None;
            i.comm_s = Some(-0.001);
        }),
        &["--comm-ms", "-1"],
    );
    rejects(
        with(&|i| {
            i.link = None;
            i.comm_s = Some(0.5);
            i.compute = Some(Compute::MeasuredStepS(0.4));
        }),
        &["--comm-ms 500", "--step-ms 400"],
    );
    rejects(
        with(&|i| i.compute = Some(Compute::MeasuredStepS(-0.4))),
        &["--step-ms", "-400"],
    );
    rejects(with(&|i| i.comm_cut = Some(0.5)), &["--comm-cut", "0.5"]);
    rejects(with(&|i| i.base_lr = Some(0.0)), &["--base-lr", "0"]);
    rejects(with(&|i| i.base_batch = Some(0)), &["--base-batch", "0"]);
    rejects(
        with(&|i| i.warmup = Some(Warmup::Epochs(-1.0))),
        &["--warmup-epochs", "-1"],
    );
    rejects(
        with(&|i| i.warmup = Some(Warmup::Epochs(91.0))),
        &["warmup", "450360"],
    );
    rejects(
        with(&|i| i.warmup = Some(Warmup::Steps(450_361))),
        &["warmup", "450361"],
    );
    rejects(
        with(&|i| i.gradient = Some(Gradient::Params(0))),
        &["--params", "0"],
    );
    rejects(
        with(&|i| i.gradient = Some(Gradient::Bytes(0))),
        &["--grad-bytes", "0"],
    );
}

#[test]
fn bandwidth_units() {
    for (s, want) in [
        ("10Gbit", 1.25e9),
        ("10Gbit/s", 1.25e9),
        ("10 Gbit/s", 1.25e9),
        ("10Gbps", 1.25e9),
        ("10Gb/s", 1.25e9),
        ("100gbit", 12.5e9),
        ("400Mbit", 50e6),
        ("500mbit", 62.5e6),
        ("2.5gbit", 312.5e6),
        ("1.25GB", 1.25e9),
        ("1.25GB/s", 1.25e9),
        ("1.25GBps", 1.25e9),
        ("25GB/s", 25e9),
        ("3.2TB/s", 3.2e12),
        ("1e3MB", 1e9),
        ("800bit/s", 100.0),
    ] {
        close(parse_bandwidth(s).expect(s), want);
    }
    for (s, needle) in [
        ("10", "no unit"),
        ("10G", "unknown unit"),
        ("10Gfoo", "unknown unit"),
        ("fast", "not a number"),
        ("0Gbit", "positive"),
        ("-1GB", "positive"),
    ] {
        match parse_bandwidth(s) {
            Err(Error::InvalidArgument(m)) => {
                assert!(m.contains("--link") && m.contains(needle), "{s}: {m}")
            }
            other => panic!("{s}: {other:?}"),
        }
    }
}

#[test]
fn counts_with_suffixes() {
    assert_eq!(
        parse_count("--params", "25.6M", false).expect("ok"),
        25_600_000
    );
    assert_eq!(
        parse_count("--params", "1281167", false).expect("ok"),
        1_281_167
    );
    assert_eq!(
        parse_count("--params", "1.28e6", false).expect("ok"),
        1_280_000
    );
    assert_eq!(
        parse_count("--params", "7G", false).expect("ok"),
        7_000_000_000
    );
    assert_eq!(parse_count("--params", "1_000", false).expect("ok"), 1000);
    assert_eq!(
        parse_count("--grad-bytes", "102.4MB", true).expect("ok"),
        102_400_000
    );
    assert_eq!(
        parse_count("--grad-bytes", "64MiB", true).expect("ok"),
        64 << 20
    );
    assert_eq!(parse_count("--grad-bytes", "1Ki", true).expect("ok"), 1024);
    assert!(parse_count("--params", "100B", false).is_err());
    assert!(parse_count("--params", "-5", false).is_err());
    assert!(parse_count("--params", "lots", false).is_err());
    assert!(parse_count("--params", "3X", false).is_err());
}

#[test]
fn grad_dtypes() {
    assert_eq!(GradDtype::parse("float").expect("ok"), GradDtype::F32);
    assert_eq!(GradDtype::parse("FP16").expect("ok"), GradDtype::F16);
    assert_eq!(GradDtype::parse("bfloat16").expect("ok"), GradDtype::BF16);
    assert_eq!(GradDtype::BF16.size(), 2);
    assert!(matches!(
        GradDtype::parse("int8"),
        Err(Error::InvalidArgument(m)) if m.contains("--grad-dtype")
    ));
}

/// A bench file as `ferroccl bench --json` writes it, with in-place times from a
/// known α and β, printed to full precision.
fn bench_json(n: usize, alpha: f64, beta: f64, fit: Option<(f64, f64)>) -> String {
    let nf = n as f64;
    let factor = 2.0 * (nf - 1.0) / nf;
    let rows: Vec<String> = (0..9)
        .map(|j| {
            let bytes = 1024u64 << (2 * j); // 1 KiB .. 64 MiB
            let t_us = (2.0 * (nf - 1.0) * alpha + factor * bytes as f64 * beta) * 1e6;
            format!(
                "    {{\"bytes\": {bytes}, \"count\": {}, \"oop_time_us\": {t_us}, \"oop_algbw_gbs\": 1.0, \"oop_busbw_gbs\": 1.0, \"oop_wrong\": 0, \"ip_time_us\": {t_us}, \"ip_algbw_gbs\": 1.0, \"ip_busbw_gbs\": 1.0, \"ip_wrong\": 0, \"payload_bytes_sent_per_rank\": 1.0, \"header_bytes_sent_per_rank\": 1.0}}",
                bytes / 4
            )
        })
        .collect();
    let fit = fit.map_or(String::new(), |(a, b)| {
        format!("  \"fit\": {{\"alpha_s\": {a}, \"beta_s_per_byte\": {b}}},\n")
    });
    format!(
        "{{\n  \"tool\": \"ferroccl bench\",\n  \"collective\": \"all_reduce\",\n  \"ranks\": {n},\n  \"transport\": \"tcp\",\n  \"dtype\": \"float\",\n  \"op\": \"sum\",\n  \"bus_factor\": {factor},\n{fit}  \"rows\": [\n{}\n  ]\n}}\n",
        rows.join(",\n")
    )
}

#[track_caller]
fn rel(got: f64, want: f64, tol: f64) {
    assert!(((got - want) / want).abs() <= tol, "got {got}, want {want}");
}

#[test]
fn bench_fit_recovers_alpha_and_beta() {
    for (n, alpha, beta) in [(4, 25e-6, 0.8e-9), (2, 3e-6, 1.0 / 12.5e9), (8, 1e-4, 1e-9)] {
        let link = link_from_bench_json(&bench_json(n, alpha, beta, None), "b.json").expect("fits");
        rel(link.alpha_s, alpha, 1e-6);
        rel(link.beta_s_per_byte, beta, 1e-6);
        assert!(link.source.contains("b.json") && link.source.contains("9 in-place rows"));
    }
}

#[test]
fn bench_fit_object_wins() {
    // The rows say α = 25 µs, β = 0.8 ns/B; the fit object says otherwise and is used.
    let text = bench_json(4, 25e-6, 0.8e-9, Some((5e-6, 1e-10)));
    let link = link_from_bench_json(&text, "f.json").expect("fit object");
    assert_eq!((link.alpha_s, link.beta_s_per_byte), (5e-6, 1e-10));
    assert!(link.source.contains("fit object"));
}

#[test]
fn bench_fit_with_negative_intercept_goes_through_origin() {
    // t = -10 µs + S × 1e-9 s/B (n = 2: factor 1): the free fit's α would be
    // negative, so α = 0 and β = Σ S·t / Σ S², slightly under 1e-9.
    let rows: Vec<String> = [1e6, 2e6, 4e6]
        .iter()
        .map(|s: &f64| {
            format!(
                "{{\"bytes\": {s}, \"ip_time_us\": {}}}",
                (s * 1e-9 - 10e-6) * 1e6
            )
        })
        .collect();
    let text = format!("{{\"ranks\": 2, \"rows\": [{}]}}", rows.join(","));
    let link = link_from_bench_json(&text, "neg.json").expect("fits");
    assert_eq!(link.alpha_s, 0.0);
    let (sxt, sxx) = [1e6f64, 2e6, 4e6].iter().fold((0.0, 0.0), |(a, b), s| {
        (a + s * (s * 1e-9 - 10e-6), b + s * s)
    });
    rel(link.beta_s_per_byte, sxt / sxx, 1e-9);
}

#[test]
fn bad_bench_files_are_config_errors_naming_the_file() {
    let row = |b: u64, t: f64| format!("{{\"bytes\": {b}, \"ip_time_us\": {t}}}");
    let cases = [
        (
            "{not json".to_string(),
            "not a `ferroccl bench --json` file",
        ),
        (
            "[1, 2, 3]".to_string(),
            "not a `ferroccl bench --json` file",
        ),
        (
            r#"{"ranks": 4, "rows": [{"bytes": "big"}]}"#.to_string(),
            "not a",
        ),
        (r#"{"ranks": 4}"#.to_string(), "no `rows`"),
        (r#"{"rows": []}"#.to_string(), "no `ranks`"),
        (r#"{"ranks": 4, "rows": []}"#.to_string(), "0 row(s)"),
        (
            format!(r#"{{"ranks": 4, "rows": [{}]}}"#, row(1024, 10.0)),
            "1 row(s)",
        ),
        (
            format!(
                r#"{{"ranks": 1, "rows": [{}, {}]}}"#,
                row(1024, 10.0),
                row(2048, 20.0)
            ),
            "1 rank(s)",
        ),
        (
            format!(
                r#"{{"ranks": 4, "rows": [{}, {}]}}"#,
                row(1024, 10.0),
                row(1024, 20.0)
            ),
            "same size",
        ),
        (
            // time falls with size: β < 0
            format!(
                r#"{{"ranks": 4, "rows": [{}, {}]}}"#,
                row(1024, 30.0),
                row(4096, 20.0)
            ),
            "not positive",
        ),
        (
            format!(
                r#"{{"ranks": 4, "rows": [{}, {}]}}"#,
                row(1024, -1.0),
                row(4096, 20.0)
            ),
            "non-negative",
        ),
        (
            r#"{"fit": {"alpha_s": 1e-6, "beta_s_per_byte": 0}}"#.to_string(),
            "not positive",
        ),
        (
            r#"{"fit": {"alpha_s": -1e-6, "beta_s_per_byte": 1e-9}}"#.to_string(),
            "negative",
        ),
    ];
    for (text, needle) in cases {
        match link_from_bench_json(&text, "runs/bench.json") {
            Err(Error::Config(m)) => assert!(
                m.contains("bench file runs/bench.json") && m.contains(needle),
                "{text}: {m}"
            ),
            other => panic!("{text}: expected Config error, got {other:?}"),
        }
    }
}

#[test]
fn formatting_helpers() {
    assert_eq!(fmt_g(0.14336000000000002), "0.14336");
    assert_eq!(fmt_g(256.0 / 0.22336), "1146.13");
    assert_eq!(fmt_g(0.0), "0");
    assert_eq!(fmt_time(0.14336), "143.36 ms");
    assert_eq!(fmt_time(25e-6), "25 µs");
    assert_eq!(fmt_time(2.5), "2.5 s");
    assert_eq!(fmt_time(100592.4096), "100592 s (1d 03h 56m 32s)");
    assert_eq!(fmt_time(3725.0), "3725 s (1h 02m 05s)");
    assert_eq!(fmt_bytes(179.2e6), "179.2 MB");
    assert_eq!(fmt_bytes(512.0), "512 B");
    assert_eq!(fmt_rate(1.25e9), "1.25 GB/s (10 Gbit/s)");
}

#[test]
fn report_shows_formulas_and_json_has_every_output() {
    let p = compute(&case_a()).expect("valid");
    let text = p.render();
    for needle in [
        "global batch             = ranks × per-rank batch × accumulation steps = 8 × 32 × 1 = 256",
        "floor(dataset size / global batch) = floor(1281167 / 256) = 5004",
        "base lr × global batch / base batch = 0.1 × 256 / 256 = 0.1",
        "ceil(warmup epochs × steps per epoch) = ceil(5 × 5004) = 25020",
        "32 × 1 / 400 / 1 = 80 ms",
        "params × 4 B (f32) = 25600000 × 4 = 102.4 MB",
        "2(N-1)/N × S = 2 × 7 / 8 × 102.4 MB = 179.2 MB",
        "14 × 0 s + 179.2 MB × 0.8 ns/B = 143.36 ms  (used)",
        "14 × 0 s + 89.6 MB × 0.8 ns/B = 71.68 ms",
        "(80 ms + 143.36 ms) / (1 − 0) = 223.36 ms",
        "= 1146.13 samples/s",
        "speedup / ranks = 2.86533 / 8 = 35.8166 %",
        "5004 × 223.36 ms = 1117.69 s",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    let v: serde_json::Value = serde_json::from_str(&p.to_json().expect("json")).expect("parses");
    assert_eq!(v["global_batch"], 256);
    assert_eq!(v["input"]["ranks"], 8);
    assert_eq!(v["input"]["grad_dtype"], "f32");
    close(v["comm_f32_s"].as_f64().expect("f64"), 0.14336);
    close(v["step_s"].as_f64().expect("f64"), 0.22336);
}
