use super::autoscale::{wanted, Load, UTILISATION};
use super::*;

/// Evenly spaced requests: `rate` per second for `secs` seconds from `from_s`.
fn steady(from_s: f64, secs: f64, rate: f64, prompt: u64, output: u64) -> Vec<TraceRequest> {
    let n = (secs * rate) as usize;
    (0..n)
        .map(|i| TraceRequest { at_ms: (from_s + i as f64 / rate) * 1e3, prompt_tokens: prompt, output_tokens: output })
        .collect()
}

/// A quiet minute, then a burst of `burst` instances' worth of 2,048-token prompts for 30 s.
fn burst(p: &Profile, burst: f64) -> Vec<TraceRequest> {
    let one = p.prefill_capacity() / 2048.0;
    let mut t = steady(0.0, 60.0, 0.5 * one, 2048, 8);
    t.extend(steady(60.0, 30.0, burst * one, 2048, 8));
    t
}

fn run(system: System, trace: &[TraceRequest], tweak: impl Fn(&mut SimConfig)) -> SimReport {
    let mut cfg = SimConfig::new(system, Profile::llama2_7b());
    tweak(&mut cfg);
    simulate(&cfg, trace).unwrap().report
}

#[test]
fn every_request_is_served_and_runs_are_deterministic() {
    let trace = burst(&Profile::llama2_7b(), 6.0);
    for s in System::ALL {
        let a = run(s, &trace, |_| {});
        let b = run(s, &trace, |_| {});
        assert_eq!(a.requests, trace.len());
        assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap(), "{s:?}");
        // No request is faster than its own prefill alone.
        assert!(a.ttft_p50_ms >= Profile::llama2_7b().prefill_ms(2048) - 1e-9, "{s:?}: {}", a.ttft_p50_ms);
        assert!(a.scale_events > 0, "{s:?} never scaled under a burst");
    }
}

#[test]
fn the_ttft_floor_is_each_prompts_own_prefill() {
    // Prompts of 256..4,056 tokens (within the context window), lightly loaded: the floor is the
    // p99 of prefill_ms(prompt).
    let p = Profile::llama2_7b();
    let trace: Vec<TraceRequest> = (0..400u64)
        .map(|i| TraceRequest { at_ms: i as f64 * 200.0, prompt_tokens: 256 + (i * 7_919) % 3_801, output_tokens: 4 })
        .collect();
    let mut own: Vec<f64> = trace.iter().map(|r| p.prefill_ms(r.prompt_tokens)).collect();
    own.sort_by(f64::total_cmp);
    let want = own[(0.99 * own.len() as f64).ceil() as usize - 1];
    for s in System::ALL {
        let r = run(s, &trace, |_| {});
        assert!((r.ttft_floor_p99_ms - want).abs() < 1e-9, "{s:?}: {} vs {want}", r.ttft_floor_p99_ms);
        // Cooperation (blitz) can at most halve a prefill; without it nothing beats the floor.
        let least = if s == System::Blitz { 0.5 * want } else { want };
        assert!(r.ttft_p99_ms >= least - 1e-9, "{s:?}: p99 {} below the floor {want}", r.ttft_p99_ms);
    }
}

#[test]
fn requests_over_the_context_window_are_clipped_refused_or_kept_as_asked() {
    // Every fourth prompt is 6,000 tokens, past Llama-2's 4,096; lightly loaded.
    let p = Profile::llama2_7b();
    let trace: Vec<TraceRequest> = (0..200u64)
        .map(|i| TraceRequest {
            at_ms: i as f64 * 500.0,
            prompt_tokens: if i % 4 == 0 { 6_000 } else { 1_000 },
            output_tokens: 8,
        })
        .collect();
    let clip = run(System::Blitz, &trace, |_| {});
    assert_eq!((clip.requests, clip.over_context, clip.over_context_policy), (200, 50, OverContext::Clip));
    assert!((clip.ttft_floor_p99_ms - p.prefill_ms(4_088)).abs() < 1e-9, "{}", clip.ttft_floor_p99_ms);
    let keep = run(System::Blitz, &trace, |c| c.over_context = OverContext::Keep);
    assert_eq!((keep.requests, keep.over_context), (200, 50));
    assert!((keep.ttft_floor_p99_ms - p.prefill_ms(6_000)).abs() < 1e-9, "{}", keep.ttft_floor_p99_ms);
    let refuse = run(System::Blitz, &trace, |c| c.over_context = OverContext::Refuse);
    assert_eq!((refuse.requests, refuse.over_context), (150, 50));
    assert!((refuse.ttft_floor_p99_ms - p.prefill_ms(1_000)).abs() < 1e-9, "{}", refuse.ttft_floor_p99_ms);
    // The refused quarter missed its SLO; the rest, lightly loaded, met it.
    assert!(refuse.slo_attainment <= 0.75 + 1e-12 && refuse.slo_attainment > 0.7, "{}", refuse.slo_attainment);
    let all_long: Vec<TraceRequest> = trace.iter().map(|r| TraceRequest { prompt_tokens: 6_000, ..*r }).collect();
    let cfg = SimConfig { over_context: OverContext::Refuse, ..SimConfig::new(System::Blitz, p) };
    assert!(simulate(&cfg, &all_long).err().is_some_and(|e| e.contains("context window")));
}

#[test]
fn the_instant_bound_loads_in_no_time_and_beats_stop_the_world_loading() {
    let trace = burst(&Profile::llama2_7b(), 6.0);
    let instant = run(System::Instant, &trace, |_| {});
    let stop = run(System::Stop, &trace, |_| {});
    assert_eq!(instant.load_s_mean, 0.0);
    assert!(instant.scale_events > 0);
    assert!(stop.load_s_mean > 0.0);
    assert!(instant.ttft_p99_ms < stop.ttft_p99_ms, "{} vs {}", instant.ttft_p99_ms, stop.ttft_p99_ms);
    assert!(instant.ttft_mean_ms <= stop.ttft_mean_ms, "{} vs {}", instant.ttft_mean_ms, stop.ttft_mean_ms);
}

#[test]
fn host_cache_use_follows_each_systems_rule() {
    let trace = burst(&Profile::llama2_7b(), 6.0);
    assert!((run(System::Blitz, &trace, |_| {}).host_cache_copies_avg - 1.0).abs() < 1e-9);
    assert!((run(System::Stop, &trace, |_| {}).host_cache_copies_avg - 1.0).abs() < 1e-9);
    assert!((run(System::Allcache, &trace, |_| {}).host_cache_copies_avg - 4.0).abs() < 1e-9);
    let sllm = run(System::Sllm, &trace, |_| {});
    assert!(sllm.host_cache_copies_avg > 1.0 && sllm.host_cache_copies_avg <= 4.0, "{}", sllm.host_cache_copies_avg);
}

#[test]
fn sllm_loads_from_ssd_on_a_miss_and_the_cache_expires() {
    // More instances than the two cached hosts hold: some must come from SSD.
    let trace = burst(&Profile::llama2_7b(), 20.0);
    let sllm = run(System::Sllm, &trace, |_| {});
    let all = run(System::Allcache, &trace, |_| {});
    assert!(sllm.cache_misses > 0, "{sllm:?}");
    assert_eq!(all.cache_misses, 0);
    assert!(sllm.load_s_mean > all.load_s_mean);
    assert!(sllm.ttft_p99_ms > all.ttft_p99_ms, "{} vs {}", sllm.ttft_p99_ms, all.ttft_p99_ms);
    // With a keep-alive of one second, a quiet minute after the burst empties every idle host's
    // cache; with five minutes they stay.
    let mut trace = trace;
    let one = Profile::llama2_7b().prefill_capacity() / 2048.0;
    trace.extend(steady(90.0, 60.0, 0.5 * one, 2048, 8));
    let sllm = run(System::Sllm, &trace, |_| {});
    let short = run(System::Sllm, &trace, |c| c.keep_alive_s = 1.0);
    assert!(short.host_cache_copies_avg < sllm.host_cache_copies_avg);
}

/// A cluster larger than the simulator takes is refused before it is built (`serve-sim --hosts
/// 100000000` asked for gigabytes of topology first).
#[test]
fn a_cluster_beyond_the_simulators_bound_is_refused_before_it_is_built() {
    let trace = steady(0.0, 2.0, 1.0, 256, 4);
    let mut cfg = SimConfig::new(System::Blitz, Profile::llama2_7b());
    cfg.hardware.hosts = 100_000_000;
    let e = simulate(&cfg, &trace).err().expect("simulated");
    assert!(e.contains("800000000 GPUs; the simulator takes at most 65536"), "{e}");
    cfg.hardware.hosts = usize::MAX;
    assert!(simulate(&cfg, &trace).is_err());
}

#[test]
fn one_gpu_per_host_has_no_nvlink_and_a_cache_per_gpu() {
    // The paper's 7B layout (§6: one GPU per logical host, 32 hosts) against cluster A's
    // physical one (4 hosts of 8), under the same burst.
    let trace = burst(&Profile::llama2_7b(), 6.0);
    let logical = |c: &mut SimConfig| {
        c.hardware.hosts = 32;
        c.hardware.gpus_per_host = 1;
    };
    for s in System::ALL {
        let r = run(s, &trace, logical);
        assert_eq!(r.requests, trace.len(), "{s:?}");
        assert_eq!(r.gpus, 32);
        assert!(r.peak_gpus > 1 && r.peak_gpus <= r.gpus, "{s:?}: peak {}", r.peak_gpus);
    }
    // The network's copies come from another GPU over RDMA only: never faster than the model
    // over one link (stop: blitz's loading without live scaling).
    let (p, hw) = (Profile::llama2_7b(), Hardware::default());
    let rdma_s = p.param_bytes as f64 * 8.0 / (hw.rdma_gbps * 1e9);
    let (stop, packed) = (run(System::Stop, &trace, logical), run(System::Stop, &trace, |_| {}));
    assert!(stop.load_s_mean >= rdma_s - 1e-9, "{} s against {rdma_s} s over RDMA", stop.load_s_mean);
    assert!(stop.load_s_mean > packed.load_s_mean, "NVLink within a host of 8 is faster");
    // A host's cache serves only its own GPU: sllm misses more, and holds more copies.
    let (sllm, sllm8) = (run(System::Sllm, &trace, logical), run(System::Sllm, &trace, |_| {}));
    assert!(sllm.cache_misses > sllm8.cache_misses, "{} vs {}", sllm.cache_misses, sllm8.cache_misses);
    assert!(sllm.host_cache_copies_avg > sllm8.host_cache_copies_avg);
}

#[test]
fn live_scaling_serves_while_a_slow_load_runs() {
    // Slow links (a few seconds per load): the paired old instance runs faster while the new one
    // holds part of the layers.
    let slow = |c: &mut SimConfig| {
        c.hardware.nvlink_gbps = 20.0;
        c.hardware.rdma_gbps = 20.0;
        c.hardware.pcie_gbps = 20.0;
    };
    let trace = burst(&Profile::llama2_7b(), 3.0);
    let blitz = run(System::Blitz, &trace, slow);
    let stop = run(System::Stop, &trace, slow);
    assert!(blitz.live_scales > 0);
    assert_eq!(stop.live_scales, 0);
    assert!(blitz.load_s_mean > 3.0, "{}", blitz.load_s_mean);
    assert!(blitz.ttft_mean_ms < stop.ttft_mean_ms, "blitz {} vs stop {}", blitz.ttft_mean_ms, stop.ttft_mean_ms);
}

#[test]
fn spare_prefill_instances_mutate_into_decode_ones() {
    // Long generations (decode-heavy) after a prefill burst left prefill instances spare.
    let p = Profile::llama2_7b();
    let one = p.prefill_capacity() / 512.0;
    let mut trace = steady(0.0, 20.0, 4.0 * one, 512, 4);
    trace.extend(steady(20.0, 20.0, 0.5 * one, 512, 1500));
    let blitz = run(System::Blitz, &trace, |_| {});
    let stop = run(System::Stop, &trace, |_| {});
    assert!(blitz.mutations > 0, "{blitz:?}");
    assert_eq!(stop.mutations, 0);
    assert_eq!(blitz.requests, trace.len());
}

#[test]
fn the_load_monitor_rule() {
    let p = Profile::llama2_7b();
    let cap = p.prefill_capacity();
    let idle = Load { recent_prompt_tokens: 0, backlog_tokens: 0, decode_seqs: 0 };
    let wanted = |p: &Profile, l| wanted(p, UTILISATION, l);
    assert_eq!(wanted(&p, idle), (1, 1));
    // Two seconds at 2.4 instances' capacity → 3 at 80%.
    let busy = Load { recent_prompt_tokens: (2.0 * 2.4 * cap * 0.8) as u64, backlog_tokens: 0, decode_seqs: 0 };
    assert_eq!(wanted(&p, busy).0, 3);
    // At a 40% target the same load wants twice the instances: ⌈4.8⌉.
    assert_eq!(super::autoscale::wanted(&p, 0.4, busy).0, 5);
    // A backlog adds what drains it in two seconds.
    let backlog = Load { backlog_tokens: (2.0 * cap * 0.8) as u64 + 1, ..busy };
    assert_eq!(wanted(&p, backlog).0, 4);
    let decode = Load { decode_seqs: p.decode_target_batch() * 3 + 1, ..idle };
    assert_eq!(wanted(&p, decode).1, 4);
    assert!(p.decode_ms(p.decode_target_batch()) <= 0.8 * p.tbt_slo_ms);
}

#[test]
fn traces_parse_rescale_and_refuse_garbage() {
    let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04.0,10,2\n2023-11-16 18:17:03.0,5,0\n";
    let t = parse_trace(text, 2.0).unwrap();
    assert_eq!(t.len(), 2);
    assert_eq!((t[0].at_ms, t[0].prompt_tokens, t[0].output_tokens), (0.0, 5, 1));
    assert!((t[1].at_ms - 500.0).abs() < 1e-6);
    assert!(parse_trace("x,y,z\n2023-11-16 18:17:04.0,ten,2\n", 1.0).unwrap_err().contains("line 2"));
    assert!(parse_trace(text, 0.0).is_err());
    assert!(parse_trace("TIMESTAMP,ContextTokens,GeneratedTokens\n", 1.0).is_err());
    let huge = [TraceRequest { at_ms: 0.0, prompt_tokens: 200_000, output_tokens: 1 }];
    // Past the KV capacity only when kept whole past the context window; clipped it runs.
    let keep = SimConfig { over_context: OverContext::Keep, ..SimConfig::new(System::Blitz, Profile::llama2_7b()) };
    let e = simulate(&keep, &huge).err().unwrap();
    assert!(e.contains("request 0 needs 200001 KV tokens"), "{e}");
    assert_eq!(simulate(&SimConfig::new(System::Blitz, Profile::llama2_7b()), &huge).unwrap().report.over_context, 1);
    assert!("blitz".parse::<System>().is_ok() && "nope".parse::<System>().is_err());
    let small = [TraceRequest { at_ms: 0.0, prompt_tokens: 100, output_tokens: 1 }];
    for u in [0.0, -0.5, 1.5, f64::NAN] {
        let cfg = SimConfig { prefill_utilisation: u, ..SimConfig::new(System::Blitz, Profile::llama2_7b()) };
        assert!(simulate(&cfg, &small).err().is_some_and(|e| e.contains("utilisation")), "{u}");
    }
    let cfg = SimConfig { prefill_utilisation: 0.5, ..SimConfig::new(System::Blitz, Profile::llama2_7b()) };
    assert_eq!(simulate(&cfg, &small).unwrap().report.prefill_utilisation, 0.5);
}

#[test]
fn the_real_code_trace_runs_under_every_system() {
    let trace = parse_trace(include_str!("../../../sched/data/AzureLLMInferenceTrace_code.csv"), 1.0).unwrap();
    assert_eq!(trace.len(), 8819);
    let first: Vec<TraceRequest> = trace.into_iter().filter(|r| r.at_ms < 600_000.0).collect();
    for s in System::ALL {
        let r = run(s, &first, |_| {});
        assert_eq!(r.requests, first.len());
        assert!(r.slo_attainment > 0.5 && r.slo_attainment <= 1.0, "{s:?}: {}", r.slo_attainment);
    }
}
