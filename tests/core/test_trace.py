"""`hstu.bench.trace`: the device's idle gaps in a profiler trace, charged to the host."""

from __future__ import annotations

import gzip
import json

import pytest

from hstu.bench import trace as tr


def _meta(pid, name, tid=None):
    kind = "process_name" if tid is None else "thread_name"
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def _x(pid, tid, name, ts, dur, **extra):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, **extra}


def _torch_like():
    """Device: kernels on stream 7 and on a graph's stream 20 (overlapping), a copy; host: the
    main thread's phases with ops inside, and a second thread that must not be charged."""
    k = {"cat": "kernel"}
    return [
        _meta(1, "python"),
        _meta(1, "main", tid=1),
        _meta(1, "autograd", tid=2),
        _x(0, 7, "gemm", 0, 100, **k),
        _x(0, 20, "graphed", 50, 100, **k),  # overlaps: busy [0, 150)
        # gap [150, 400): host in forward_backward: 'aten::cat' for [150, 250), then Python
        _x(0, 7, "attn", 400, 100, **k),
        _x(0, 7, "memcpy", 500, 50, cat="gpu_memcpy"),  # busy [400, 550)
        # gap [550, 555): shorter than min_gap_us, counted as idle but not charged
        _x(0, 7, "adamw", 555, 45, **k),  # busy [555, 600)
        # gap [600, 1000): host waits in fetch_wait / cudaEventSynchronize
        _x(0, 7, "next", 1000, 200, **k),
        _x(1, 1, "hstu.forward_backward", 100, 320),
        _x(1, 1, "aten::cat", 150, 100),
        _x(1, 1, "cudaLaunchKernel", 395, 5),
        _x(1, 1, "hstu.fetch_wait", 590, 420),
        _x(1, 1, "cudaEventSynchronize", 600, 400),
        _x(1, 2, "AddmmBackward0", 0, 2000),  # another thread: never charged
    ]


def test_gaps_are_the_union_of_all_streams_charged_to_the_innermost_host_event():
    report = tr.idle_report(_torch_like(), steps=2, min_gap_us=10)
    assert report.window_us == 1200
    assert report.busy_us == 150 + 150 + 45 + 200
    assert report.idle_us == 250 + 5 + 400
    assert [(g.start, g.end, g.before, g.after) for g in report.gaps] == [
        (150, 400, "graphed", "attn"),
        (600, 1000, "adamw", "next"),
    ]
    assert report.host_thread == "python | main"
    assert dict(report.gaps[0].charged) == {
        ("hstu.forward_backward", "aten::cat"): 100,
        ("hstu.forward_backward", "(python)"): 145,
        ("hstu.forward_backward", "cudaLaunchKernel"): 5,
    }
    assert dict(report.by_phase()) == {"hstu.forward_backward": 250, "hstu.fetch_wait": 400}
    assert report.charged()[("hstu.fetch_wait", "cudaEventSynchronize")] == 400
    text = "\n".join(report.lines())
    assert "device busy 0.27 ms per step, idle 0.33 ms per step" in text
    assert "0.200  hstu.fetch_wait > cudaEventSynchronize" in text


def test_jax_traces_count_only_the_device_streams(tmp_path):
    """jax.profiler puts kernels on '/device:GPU:N' 'Stream #..' threads, and spans derived
    from them ('XLA Ops', 'XLA Modules') on other threads of the same process: a module span
    covering a gap must not hide it."""
    events = [
        _meta(9, "/device:GPU:0"),
        _meta(9, "Stream #14(Compute,Memset)", tid=14),
        _meta(9, "XLA Modules", tid=1),
        _meta(3, "/host:CPU"),
        _meta(3, "python", tid=5),
        _x(9, 1, "jit_step", 0, 1000),
        _x(9, 14, "fusion.1", 0, 300),
        _x(9, 14, "fusion.2", 700, 300),
        _x(3, 5, "hstu.data_wait", 250, 200),
        _x(3, 5, "PjitFunction(step)", 500, 250),
    ]
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    report = tr.idle_report(tr.load(str(path)), steps=1)
    assert report.busy_us == 600 and report.idle_us == 400
    assert dict(report.gaps[0].charged) == {
        ("hstu.data_wait", "(python)"): 150,
        ("(between phases)", "(no event)"): 50,
        ("(between phases)", "PjitFunction(step)"): 200,
    }


def test_a_trace_without_device_events_is_an_error():
    with pytest.raises(ValueError, match="no device events"):
        tr.idle_report([_meta(1, "python"), _x(1, 1, "aten::mm", 0, 10)], steps=1)


def test_host_self_time_by_phase_on_the_dispatching_thread_only():
    report = tr.host_report(_torch_like(), steps=2)
    assert report.host_thread == "python | main"
    assert dict(report.self_us) == {
        ("hstu.forward_backward", "(python)"): 215,
        ("hstu.forward_backward", "aten::cat"): 100,
        ("hstu.forward_backward", "cudaLaunchKernel"): 5,
        ("hstu.fetch_wait", "(python)"): 20,
        ("hstu.fetch_wait", "cudaEventSynchronize"): 400,
    }
    text = "\n".join(report.lines())
    assert "0.210  hstu.fetch_wait" in text and "0.160  hstu.forward_backward" in text


def test_frames_nest_and_phases_are_placed_by_time():
    """A frame that outlives its parent is cut at the parent's end; a phase may open inside a
    short frame (jax: its own `__enter__`) and outlive it, so phases split self time by time."""
    events = [
        _meta(1, "python"),
        _meta(1, "main", tid=1),
        _x(1, 1, "outer", 0, 300),
        _x(1, 1, "__enter__", 5, 7),
        _x(1, 1, "hstu.exchange", 10, 90),
        _x(1, 1, "device_put", 50, 100),
        _x(1, 1, "late", 200, 200),  # cut at 300
    ]
    assert dict(tr.host_report(events, steps=1).self_us) == {
        ("(between phases)", "__enter__"): 5,
        ("hstu.exchange", "__enter__"): 2,
        ("(between phases)", "outer"): 5 + 50,
        ("hstu.exchange", "outer"): 38,
        ("hstu.exchange", "device_put"): 50,
        ("(between phases)", "device_put"): 50,
        ("(between phases)", "late"): 100,
    }


def test_the_timeline_shows_one_step_of_host_and_device_in_order():
    events = _torch_like() + [_x(1, 1, "hstu.forward_backward", 1100, 50)]
    assert tr.timeline(events, min_us=1) == [
        "  -0.100  DEVICE busy 0.150 ms (gemm .. graphed)",
        "   0.000  hstu.forward_backward 0.320 ms",
        "   0.050    aten::cat 0.100 ms",
        "   0.295    cudaLaunchKernel 0.005 ms",
        "   0.300  DEVICE busy 0.150 ms (attn .. memcpy)",
        "   0.455  DEVICE busy 0.045 ms (adamw .. adamw)",
        "   0.490  hstu.fetch_wait 0.420 ms",
        "   0.500    cudaEventSynchronize 0.400 ms",
        "   0.900  DEVICE busy 0.200 ms (next .. next)",
    ]
    assert "fewer than two" in tr.timeline(_torch_like())[0]


def test_kernel_classes_sum_device_time_by_class_and_count_the_short_kernels():
    k = {"cat": "kernel"}
    events = [
        _meta(1, "python"),
        _meta(1, "main", tid=1),
        _x(0, 7, "sm90_xmma_gemm_bf16bf16_bf16f32", 0, 100, **k),
        _x(0, 7, "_hstu_fwd_kernel", 100, 50, **k),
        _x(0, 20, "_hstu_bwd_dq_kernel", 150, 40, **k),
        _x(0, 7, "_layer_norm_fwd_kernel", 200, 6, **k),
        _x(0, 7, "multi_tensor_apply_kernel<FusedAdamMathFunctor>", 210, 30, **k),
        _x(0, 7, "vectorized_elementwise_kernel<FillFunctor<float>>", 240, 4, **k),
        _x(0, 7, "Memset (Device)", 250, 2, cat="gpu_memset"),
        _x(0, 7, "vectorized_elementwise_kernel<silu_kernel>", 260, 5, **k),
        _x(1, 1, "aten::mm", 0, 100),  # host: not counted
    ]
    got = tr.kernel_classes(events, steps=2, short_us_max=8.0)
    assert got.rows == {
        "matmul": [100, 1, 0, 0],
        "attention": [90, 2, 0, 0],
        "norm": [6, 1, 1, 6],
        "optimizer": [30, 1, 0, 0],
        "copy / fill": [6, 2, 2, 6],
        "other": [5, 1, 1, 5],
    }
    lines = got.lines()
    assert lines[1].split()[:3] == ["matmul", "0.050", "0.5"]  # per step, largest first
    assert lines[-1].split()[:5] == ["all", "0.118", "4.0", "2.0", "0.009"]


def test_kernel_classes_split_jax_fusions_by_the_kind_xla_emitted():
    """JAX's kernels: Mosaic GPU kernels are our attention, XLA's GEMM fusions matmuls, and its
    other fusions are told apart by the kind in their names (a reduction, a scatter or
    gather, elementwise, XLA's other fusions)."""
    want = {
        "entry_mosaic_gpu_kernel": "attention",
        "hstu_attention_bwd_dkdv": "attention",
        "gemm_fusion_dot_general_107": "matmul",
        "nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT": "matmul",
        "input_add_reduce_fusion": "xla reduce",
        "input_reduce_fusion_44": "xla reduce",
        "loop_reduce_window_fusion_1": "xla reduce",
        "input_scatter_fusion_10": "xla scatter",
        "loop_gather_fusion": "xla scatter",
        "loop_slice_fusion_7": "xla elemwise",
        "input_concatenate_fusion_1": "xla elemwise",
        "wrapped_convert_2": "xla elemwise",
        "fusion_1102": "xla fusion",
        "loop_copy_fusion": "copy / fill",
        "vectorized_elementwise_kernel<silu_kernel>": "other",
    }
    assert {name: tr.kernel_class(name) for name in want} == want


def test_device_busy_in_ranges_counts_each_ranges_device_work_once():
    """jax-like: device events on `/device:GPU:0` `Stream #` threads (two streams, one kernel
    overlapping another), host ranges on the python thread; a kernel counts for the range it
    started in, idle time and events outside every range for none."""
    events = [
        _meta(1, "/host:CPU"),
        _meta(1, "python", tid=1),
        _meta(2, "/device:GPU:0"),
        _meta(2, "Stream #14(Compute)", tid=14),
        _meta(2, "Stream #15(MemcpyH2D)", tid=15),
        _meta(2, "XLA Ops", tid=3),  # derived from the streams: never counted
        _x(1, 1, "hstu.timed/fwd/0", 0, 100),
        _x(1, 1, "hstu.timed/fwd/1", 200, 100),
        _x(1, 1, "hstu.timed/idle/0", 400, 50),
        _x(1, 1, "other range", 500, 100),
        _x(2, 14, "entry_mosaic_gpu_kernel", 10, 40),
        _x(2, 15, "copy", 30, 30),  # overlaps: busy [10, 60)
        _x(2, 14, "loop_select_fusion", 70, 20),  # [70, 90): 70 us in range 0
        _x(2, 3, "fusion", 10, 80),
        _x(2, 14, "entry_mosaic_gpu_kernel", 290, 50),  # starts inside range 1, ends after it
        _x(2, 14, "late", 310, 5),  # between ranges: counted nowhere
        _x(2, 14, "outside", 520, 30),  # in a range of another name
    ]
    busy = tr.device_busy_in_ranges(events, "hstu.timed/")
    assert busy == {"hstu.timed/fwd/0": 70, "hstu.timed/fwd/1": 50, "hstu.timed/idle/0": 0}


def test_short_kernels_group_by_source_largest_first():
    """Kernels under the limit, grouped by `source(name)` (the name where it gives None),
    per step, largest group first; long kernels and host events left out."""
    k = {"cat": "kernel"}
    events = [
        _meta(1, "python"),
        _meta(1, "main", tid=1),
        _x(0, 7, "loop_add_fusion_3", 0, 2, **k),
        _x(0, 7, "loop_add_fusion_9", 10, 3, **k),
        _x(0, 7, "input_reduce_fusion_1", 20, 4, **k),
        _x(0, 7, "wrapped_convert", 30, 1, **k),
        _x(0, 7, "nvjet_gemm", 40, 90, **k),  # long: not listed
        _x(1, 1, "aten::add", 0, 2),  # host: not listed
    ]
    adam = {"loop_add_fusion_3": "adamw/add", "loop_add_fusion_9": "adamw/add"}
    lines = tr.short_kernels(events, steps=2, source=adam.get, short_us_max=8.0)
    rows = [line.split() for line in lines[1:]]
    assert rows[0] == ["0.003", "1.0", "adamw/add"]  # 2 + 3 us over 2 steps
    assert rows[1] == ["0.002", "0.5", "input_reduce_fusion_1"]
    assert rows[2] == ["0.001", "0.5", "wrapped_convert"]
    assert rows[-1][:2] == ["0.005", "2.0"] and "under 8 us" in lines[-1]
    assert tr.short_kernels(events, steps=1, short_us_max=2.5)[1].split()[-1] == "loop_add_fusion_3"


def test_short_name_puts_what_tells_torch_kernels_apart_first():
    name = (
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::"
        "where_kernel_impl(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::"
        "{lambda()#9}::operator()() const::{lambda(bool, c10::BFloat16, c10::BFloat16)#1}, "
        "std::array<char*, 4ul> >(int)"
    )
    assert tr.short_name(name).startswith("vectorized_elementwise_kernel<4, where_kernel_impl(")
    assert "BFloat16, BFloat16" in tr.short_name(name)
    assert tr.short_name("loop_add_fusion_3") == "loop_add_fusion_3"


def test_kernel_sequence_lists_device_events_in_order_with_the_idle_time_before_each():
    lines = tr.kernel_sequence(_torch_like())
    rows = [line.split(None, 3) for line in lines[1:]]
    # host events are left out; the graph's kernel overlaps the gemm (no gap before it)
    assert [r[3] for r in rows] == ["gemm", "graphed", "attn", "memcpy", "adamw", "next"]
    assert [float(r[0]) for r in rows] == [0.0, 0.05, 0.4, 0.5, 0.555, 1.0]
    assert [float(r[1]) for r in rows] == [100, 100, 100, 50, 45, 200]
    assert [float(r[2]) for r in rows] == [0, 0, 250, 0, 5, 400]
    assert tr.kernel_sequence([_meta(1, "python")]) == []
