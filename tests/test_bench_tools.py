"""The benchmark tools' arguments (a bad value: one argparse line naming the option, before any
model is built; a --json path that cannot be written: before the benchmark, not after it) and
what bench_sweep's reset options do."""
import pytest

CUDA_HERE = __import__("torch").cuda.is_available()


def _refused(main, argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,named", [
    (["--runs", "0"], "argument --runs: 0 is not > 0"),
    (["--n_utts", "0"], "argument --n_utts: 0 is not > 0"),
    (["--seconds", "0.01"], "argument --seconds: 0.01 is not >= 0.1"),   # was torch's conv error
    (["--threads", "x"], "argument --threads: 'x' is not a int"),
    (["--seconds", "inf"], "argument --seconds: inf is not a finite number"),
    (["--json", "/no/such/dir/x.json"], "argument --json: /no/such/dir/x.json: folder /no/such/dir "
                                        "does not exist"),
    (["--json", "/tmp"], "argument --json: /tmp is a folder"),    # its figures lost at the end
    # was accepted, recorded as "dynamic" in the JSON, and run without a reset policy
    (["--method", "suta", "--reset", "dynamic"], "--reset dynamic: suta runs without a reset "
                                                 "policy here"),
    (["--method", "lame", "--reset", "fixed"], "--reset fixed: lame runs without a reset policy"),
])
def test_bench_sweep_refuses_bad_arguments_in_one_line(argv, named, capsys):
    import bench_sweep
    assert named in _refused(bench_sweep.main, argv, capsys)


@pytest.mark.parametrize("argv,named", [
    (["--n_utts", "0"], "argument --n_utts: 0 is not > 0"),      # was a StatisticsError
    (["--repeats", "0"], "argument --repeats: 0 is not > 0"),
    (["--two_lengths", "abc"], "argument --two_lengths: 'abc' is not a float"),
    (["--two_lengths", "3"], "argument --two_lengths: '3': 2 values, comma-separated"),
    (["--two_lengths", "3,8,9"], "argument --two_lengths: '3,8,9': 2 values, comma-separated"),
    (["--two_lengths", "0,8"], "argument --two_lengths: 0 is not > 0"),     # each length > 0
    # these ran: a fixed cost of 10^8 s from a slope over max(A - B, 1e-9); --repeats unused
    (["--two_lengths", "8,3"], "--two_lengths 8,3: A must be shorter than B"),
    (["--two_lengths", "3,3"], "--two_lengths 3,3: A must be shorter than B"),
    (["--two_lengths", "3,8", "--repeats", "2"], "--repeats: not with --two_lengths"),
    (["--stream", "/no/such.csv"], "--stream /no/such.csv: no such file"),
    (["--json", "/no/such/dir/x.json"], "folder /no/such/dir does not exist"),
    (["--warmup", "-1"], "argument --warmup: -1 is not >= 0"),            # was a ZeroDivisionError
    (["--model", "/no/model"], "--model /no/model: not a save_pretrained CTC model folder"),
    (["--model", "/"], "--model /: not a save_pretrained CTC model folder (no config.json)"),
    # these were accepted: --lr nan ran with every step skipped and timings that looked valid
    (["--lr", "nan"], "argument --lr: nan is not a finite number"),
    (["--lr", "0"], "argument --lr: 0 is not > 0"),
    (["--seconds", "inf"], "argument --seconds: inf is not a finite number"),
    (["--suta_steps", "0"], "argument --suta_steps: 0 is not > 0"),
    (["--dsuta_steps", "-1"], "argument --dsuta_steps: -1 is not > 0"),
    (["--buffer_size", "0"], "argument --buffer_size: 0 is not > 0"),
    (["--reset_K", "1"], "argument --reset_K: 1 is not >= 4"),
    (["--reset_K", "8"], "dsuta+dynamic: reset_K = 8 with buffer_size = 5: phi_D is saved after "
                         "K/2 = 4 utterances, before the first meta-update (every 5), so it is "
                         "the source model, every LII is 0 and the reset never fires; use "
                         "reset_K >= 10 (--reset_K, --buffer_size)"),
    (["--reset_patience", "0"], "argument --reset_patience: 0 is not > 0"),
    (["--reset_threshold", "nan"], "argument --reset_threshold: nan is not a finite number"),
    (["--cuda_graph_warmup", "-1"], "argument --cuda_graph_warmup: -1 is not >= 0"),
    (["--cuda_graph_buckets", "-0.5"], "argument --cuda_graph_buckets: -0.5 is not >= 0"),
    (["--cuda_graph_cache", "-2"], "argument --cuda_graph_cache: -2 is not > 0"),
    (["--cuda_graph_cache", "x"], "argument --cuda_graph_cache: 'x' is not a int"),
    (["--cuda_graph_cache", "autos"], "argument --cuda_graph_cache: 'autos' is not a int"),
    # these failed only after the model was built (a seed numpy refuses, a profile of no entry)
    # or were silently unused (--lengths and --profile with a mode that times otherwise)
    (["--seed", str(2 ** 64)], f"argument --seed: {2 ** 64} is not between 0 and 4294967295"),
    (["--seed", "-1"], "argument --seed: -1 is not between 0 and 4294967295"),
    (["--seed", "9" * 400], f"argument --seed: {'9' * 400} is not between 0 and 4294967295"),
    (["--profile", "sutaa"], "--profile sutaa: not an entry of this run (entries: unit_fb, "
                             "unit_f, "),
    (["--methods", "suta", "--profile", "dsuta"], "--profile dsuta: not an entry of this run"),
    (["--two_lengths", "3,8", "--lengths", "repeat"], "--lengths: not with --two_lengths"),
    (["--two_lengths", "3,8", "--profile", "suta"], "--profile: not with --two_lengths"),
    (["--population", "--lengths", "fresh"], "--lengths: not with --population"),
] + ([] if CUDA_HERE else [(["--device", "cuda:0"], "--device=cuda:0: no CUDA device here")]))
def test_bench_speed_refuses_bad_arguments_in_one_line(argv, named, capsys):
    import bench_speed
    assert named in _refused(bench_speed.parse_args, argv, capsys)


@pytest.mark.parametrize("argv,named", [
    (["--lengths", "10", "0"], "argument --lengths: 0 is not > 0"),   # was an IndexError
    (["--seconds", "2", "1"], "--seconds 2 1: min, then max"),
    (["--hidden", "0"], "argument --hidden: 0 is not > 0"),             # these were tracebacks
    (["--n_lengths", "-1"], "argument --n_lengths: -1 is not >= 0"),
    (["--window", "0"], "argument --window: 0 is not > 0"),
    (["--lengths", "2", "--workdir", __file__], f"--workdir {__file__}: a file, not a folder"),
    (["--json", "/no/such/dir/x.json"], "folder /no/such/dir does not exist"),
    (["--tolerance_mb", "nan"], "argument --tolerance_mb: nan is not a finite number"),  # all GREW
    (["--slope_tolerance", "-1"], "argument --slope_tolerance: -1 is not >= 0"),
    (["--trim_every", "-5"], "argument --trim_every: -5 is not >= 0"),
    (["--prefetch", "-1"], "argument --prefetch: -1 is not >= 0"),
    # the shell's space form: argparse said only "expected one argument" (as grid.py did)
    (["--decode_opts", "--lr=1e-4"], "argument --decode_opts: expected one argument; a value "
                                     "that starts with '-' goes after '=': "
                                     "--decode_opts=\"--lr=1e-4\""),
] + ([] if CUDA_HERE else [(["--device", "cuda:0"], "--device=cuda:0: no CUDA device here")]))
def test_bench_memory_refuses_bad_arguments_in_one_line(argv, named, capsys):
    import bench_memory
    assert named in _refused(bench_memory.main, argv, capsys)


def test_bench_speed_takes_the_values_the_runs_take(tmp_path, monkeypatch):
    """The refusals above stop at what the runs refuse: K only against dsuta+dynamic's buffer,
    auto or a number for the graph options, any finite reset threshold, a --json file named
    without a folder (the current one's, kept as given)."""
    import bench_speed
    monkeypatch.chdir(tmp_path)
    assert bench_speed.parse_args(["--json", "figures.json"]).json == "figures.json"
    a = bench_speed.parse_args(["--reset_K", "8", "--methods", "source,suta+dynamic",
                                "--cuda_graph_cache", "auto", "--cuda_graph_buckets", "0",
                                "--cuda_graph_warmup", "0", "--reset_threshold", "-1.5"])
    assert (a.reset_K, a.cuda_graph_cache, a.cuda_graph_buckets) == (8, "auto", 0.0)
    assert (a.cuda_graph_warmup, a.reset_threshold) == (0, -1.5)
    a = bench_speed.parse_args(["--reset_K", "12", "--buffer_size", "6", "--cuda_graph_cache", "3"])
    assert (a.reset_K, a.buffer_size, a.cuda_graph_cache) == (12, 6, 3)
    a = bench_speed.parse_args(["--seed", str(2 ** 32 - 1), "--methods", "suta,dsuta",
                                "--profile", "dsuta"])
    assert (a.seed, a.profile, a.lengths) == (2 ** 32 - 1, "dsuta", "fresh")
    assert bench_speed.parse_args(["--profile", "unit_fb_train", "--lengths", "repeat"]).lengths \
        == "repeat"
    assert bench_speed.parse_args(["--two_lengths", "3,8"]).lengths == "fresh"


def test_bench_speed_fixed_cost_is_the_line_through_the_points():
    """The slope's denominator was max(a2 - a1, 1e-9): points given longest first (whose mean
    lengths can also come out so) made a slope of 10^8; equal lengths have no line."""
    import math
    import bench_speed
    assert bench_speed.fixed_cost((8.0, 0.18), (3.0, 0.13)) == pytest.approx((0.1, 0.01))
    assert all(math.isnan(v) for v in bench_speed.fixed_cost((3.0, 0.1), (3.0, 0.2)))


def test_bench_speed_two_lengths_writes_json_and_keeps_columns_apart(tmp_path, monkeypatch,
                                                                    capsys):
    """--json was ignored with --two_lengths (no file); wide or negative figures ran together
    ('0.0153375142615.9265-45962622.5020')."""
    import json
    import bench_speed

    class Entry:
        def process(self, wav, info):
            return ""

    walls = iter([2e8, 1.0])       # one utterance per length: a huge slope and intercept
    monkeypatch.setattr(bench_speed, "make_entry", lambda *a: Entry())
    monkeypatch.setattr(bench_speed, "timed", lambda *a: (next(walls), 0.0))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "two.json"
    res = bench_speed.main(["--two_lengths", "3,8", "--methods", "suta", "--n_utts", "1",
                            "--warmup", "0", "--model", str(model), "--device", "cpu",
                            "--json", str(out)])
    r = res["suta"]
    assert r["fixed_s_per_utt"] > 1e8 and r["s_per_audio_s"] < -1e7
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("suta"))
    assert row.split() == ["suta", "200000000.0000", "1.0000", f"{r['fixed_s_per_utt']:.4f}",
                           f"{r['s_per_audio_s']:.4f}"]
    data = json.loads(out.read_text())
    assert data["mode"] == "two_lengths" and data["lengths_s"] == [3.0, 8.0]
    assert data["n_utts_per_length"] == 1 and data["options"]["repeats"] is None
    assert data["methods"]["suta"] == {
        "points": [{"audio_s_per_utt": a, "s_per_utt": t} for a, t in r["points"]],
        "fixed_s_per_utt": r["fixed_s_per_utt"], "s_per_audio_s": r["s_per_audio_s"]}
    assert [p["s_per_utt"] for p in data["methods"]["suta"]["points"]] == [2e8, 1.0]


def test_bench_speed_figures_are_the_clocks_over_the_audio(tiny_model_dir, tmp_path, monkeypatch,
                                                         capsys):
    """The table's figures from a known clock (real model, real passes; each entry's time a set
    rate of the audio it processed, a unit pass's first run of an input at its new-length rate):
    s per audio s, the unit costs on a seen and a new length, the passes' prediction (counts x
    unit costs + the first pass's new-length extra), overhead, the ratios to SUTA, per clock.
    FOA's forwards have no backward: each costed at the no-grad forward's rate, not fwd+bwd's."""
    import json
    import bench_speed
    rates = {"unit_fb": (0.5, 0.3), "unit_f": (0.2, 0.1), "suta": 4.0, "source": 0.15, "foa": 3.0}
    calls, lengths = {}, {}

    def timed(entry, wav, info, device):
        entry.process(wav, info)
        if isinstance(entry, bench_speed.UnitPass):
            k = calls[id(entry)] = calls.get(id(entry), -1) + 1      # new length, then seen
            rate = rates["unit_" + entry.kind][k % 2]
            name = "unit_" + entry.kind
        else:
            rate = rates[entry.name]
            name = entry.name
        lengths.setdefault(name, set()).add(wav.numel())
        wall = rate * wav.numel() / 16000
        return wall, wall / 2                                         # CPU: half the wall
    monkeypatch.setattr(bench_speed, "timed", timed)
    out = tmp_path / "bench.json"
    res = bench_speed.main(["--model", tiny_model_dir, "--n_utts", "2", "--seconds", "1.5",
                            "--repeats", "2", "--warmup", "1", "--methods", "source,suta,foa",
                            "--suta_steps", "2", "--json", str(out)])
    assert res["suta"]["counts_per_utt"] == dict(adapt_forward=2, adapt_backward=2,
                                                 infer_forward=1, aux_forward=0)
    assert res["source"]["counts_per_utt"] == dict(adapt_forward=0, adapt_backward=0,
                                                   infer_forward=1, aux_forward=0)
    assert res["foa"]["counts_per_utt"] == dict(adapt_forward=28, adapt_backward=0,   # 27 + best
                                                infer_forward=0, aux_forward=0)
    suta_pass = 2 * 0.3 + 1 * 0.1 + (0.5 - 0.3)       # first pass a backward: at fb's new length
    source_pass = 1 * 0.1 + (0.2 - 0.1)                # no backward: at the forward's
    foa_pass = 28 * 0.1 + (0.2 - 0.1)                  # forwards without a backward: as source's
    data = json.loads(out.read_text())
    # --lengths fresh: each entry its own length of every utterance, each round its utterances
    assert all(len(v) == 4 for v in lengths.values())                  # 2 rounds x 2 utterances
    sets = list(lengths.values())
    assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:])
    timed_utts = bench_speed.generated_stream(1 + 2 * 2, 1.5)[1:]     # after the warm-up one
    mean_s = sum(w.numel() for _, w in timed_utts) / 16000 / 4
    assert data["mean_utt_s"] == pytest.approx(mean_s)
    printed = capsys.readouterr().out
    assert f"2 rounds x 2 utts (mean {mean_s:.2f} s; lengths: fresh)" in printed
    for clock, scale in (("wall", 1.0), ("cpu", 0.5)):
        units = data["units"][clock]
        for u in ("unit_fb", "unit_f"):
            new, seen = rates[u]
            assert units[u]["s_per_audio_s"] == pytest.approx(scale * seen)
            assert units[u]["new_length_s_per_audio_s"] == pytest.approx(scale * new)
        for m, s, p in (("suta", 4.0, suta_pass), ("source", 0.15, source_pass),
                        ("foa", 3.0, foa_pass)):
            r = data["methods"][m][clock]
            assert r == res[m][clock]
            assert r["s_per_audio_s"] == pytest.approx(scale * s)
            assert r["pass_s_per_audio_s"] == pytest.approx([scale * p] * 2)
            assert r["overhead_s_per_audio_s"] == pytest.approx(scale * (s - p))
            assert r["overhead_frac"] == pytest.approx((s - p) / s)
            assert r["ratio_to_suta"] == pytest.approx(s / 4.0)
            assert r["pass_ratio_to_suta"] == pytest.approx(p / suta_pass)
    rows = [line.split() for line in printed.splitlines() if line.startswith("source ")]
    assert rows[0] == ["source", "0.1500", "0.0", "1.0", "0.0", "0.037", f"{0.2 / 0.9:.3f}",
                       "-0.0500", "-33.3%"]
    assert rows[1][1] == "0.0750"                      # the CPU table
    rows = [line.split() for line in printed.splitlines() if line.startswith("foa ")]
    assert rows[0][:4] == ["foa", "3.0000", "28.0/0.0", "0.0"]     # forwards / backwards


def test_bench_speed_rounds_fresh_and_repeated():
    """--lengths fresh: every round its own utterances after the warm-up ones; repeat: every
    round the same ones."""
    import bench_speed
    args = bench_speed.parse_args(["--n_utts", "2", "--repeats", "3", "--warmup", "1",
                                   "--seconds", "0.5", "--device", "cpu"])
    warm, rounds = bench_speed.load_utterances(args)
    ids = [[info.id for info, _ in rnd] for rnd in rounds]
    assert [i.id for i, _ in warm] == ["gen0"]
    assert ids == [["gen1", "gen2"], ["gen3", "gen4"], ["gen5", "gen6"]]
    args.lengths = "repeat"
    warm, rounds = bench_speed.load_utterances(args)
    assert [[info.id for info, _ in rnd] for rnd in rounds] == [["gen1", "gen2"]] * 3


def test_bench_speed_train_unit_passes_in_train_mode(tiny_model_dir):
    """unit_fb_train's forward runs with the model in train mode (dropout etc., as a train-mode
    method adapts), and leaves it in eval mode; unit_fb's and unit_f's run in eval mode."""
    import torch
    import bench_speed
    args = bench_speed.parse_args(["--device", "cpu"])
    wav = bench_speed.generated_stream(1, 0.6)[0][1]
    for name, want in (("unit_fb_train", [True, True]), ("unit_fb", [False, False]),
                       ("unit_f", [False, False])):
        e = bench_speed.make_entry(name, args, tiny_model_dir, torch.device("cpu"))
        modes, logits = [], e.lobe.logits

        def spy(x, _logits=logits, _e=e):
            modes.append(_e.lobe.model.training)
            return _logits(x)
        e.lobe.logits = spy
        info = bench_speed.UttInfo(id="u", position=0, domain="d", segment=0)
        e.prime(wav, info)
        e.process(wav, info)
        assert modes == want and not e.lobe.model.training, name


def test_bench_speed_timed_returns_wall_then_cpu(monkeypatch):
    """timed: (wall, process CPU) seconds around the entry's process, from their own clocks."""
    from types import SimpleNamespace
    import torch
    import bench_speed
    wall, cpu = iter([10.0, 13.0]), iter([100.0, 101.5])
    monkeypatch.setattr(bench_speed, "time", SimpleNamespace(perf_counter=lambda: next(wall),
                                                             process_time=lambda: next(cpu)))
    seen = []

    class Entry:
        def process(self, wav, info):
            seen.append((wav, info))
    assert bench_speed.timed(Entry(), "w", "i", torch.device("cpu")) == (3.0, 1.5)
    assert seen == [("w", "i")]


def test_bench_speed_entries_take_the_options_given(tiny_model_dir):
    """The runtime options go to the entry's lobe, DSUTA's and the reset's to the method."""
    import torch
    import bench_speed
    args = bench_speed.parse_args([
        "--methods", "dsuta+dynamic", "--cache_features", "off", "--onednn_backward",
        "--convolutions", "gemm", "--slow_grad", "recompute", "--buffer_size", "3",
        "--dsuta_steps", "3", "--reset_K", "12", "--reset_patience", "4",
        "--reset_threshold", "1.5", "--device", "cpu"])
    e = bench_speed.make_entry("dsuta+dynamic", args, tiny_model_dir, torch.device("cpu"))
    rt = e.lobe.runtime
    assert (rt.cache_features, rt.cpu_native_backward, rt.convolutions) == ("off", False, "gemm")
    assert (e.slow_grad, e.M, e.steps) == ("recompute", 3, 3)
    p = e.reset_policy
    assert (type(p).__name__, p.K, p.patience, p.threshold) == ("DynamicReset", 12, 4, 1.5)


def test_bench_speed_two_lengths_recovers_a_known_line(tmp_path, monkeypatch):
    """Each utterance timed at 0.1 s + 0.02 s per audio second: the points are the means per
    utterance (audio and time, several utterances a length) and the line through them gives back
    the fixed cost and the slope."""
    import bench_speed

    class Entry:
        def process(self, wav, info):
            return ""
    monkeypatch.setattr(bench_speed, "make_entry", lambda *a: Entry())
    monkeypatch.setattr(bench_speed, "timed",
                        lambda e, wav, info, device: (0.1 + 0.02 * wav.numel() / 16000, 0.0))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = bench_speed.main(["--two_lengths", "1,4", "--methods", "suta", "--n_utts", "3",
                          "--warmup", "0", "--model", str(model), "--device", "cpu"])["suta"]
    (a1, t1), (a2, t2) = r["points"]
    assert 0.75 <= a1 <= 1.25 and 3.0 <= a2 <= 5.0
    assert (t1, t2) == (pytest.approx(0.1 + 0.02 * a1), pytest.approx(0.1 + 0.02 * a2))
    assert (r["fixed_s_per_utt"], r["s_per_audio_s"]) == (pytest.approx(0.1), pytest.approx(0.02))


def test_bench_memory_tail_slope_and_windows():
    """The tail slope is the least-squares slope of the last half in MiB per 100 utterances (a
    fall is negative); windows are the medians of consecutive windows, the last one shorter."""
    import math
    import bench_memory
    rise = [500.0] * 10 + [500.0 + 0.02 * i for i in range(10)]     # flat, then 2 MiB per 100
    assert bench_memory.tail_slope(rise) == pytest.approx(2.0)
    assert bench_memory.tail_slope(rise, start=0) < 2.0
    assert bench_memory.tail_slope([9.0, 8.0, 7.0, 6.0]) == pytest.approx(-100.0)
    assert bench_memory.tail_slope([7.0, 2.0, 3.0]) == pytest.approx(100.0)   # from the 2nd
    assert math.isnan(bench_memory.tail_slope([7.0, 2.0]))        # one point: no slope
    assert bench_memory.windows([1, 2, 9, 4, 5, 6, 7], 3) == [2, 5, 7]


def test_bench_memory_rss_in_mib(monkeypatch):
    """/proc's kB in MiB; without /proc, ru_maxrss (kB on Linux, bytes on macOS)."""
    import sys
    import resource
    from types import SimpleNamespace
    import bench_memory
    monkeypatch.setattr(bench_memory, "_status_kb", {"VmRSS": 2048, "VmHWM": 3072}.get)
    assert (bench_memory.rss_mb(), bench_memory.peak_rss_mb()) == (2.0, 3.0)
    monkeypatch.setattr(bench_memory, "_status_kb", lambda key: None)
    usage = SimpleNamespace(ru_maxrss=5120)
    monkeypatch.setattr(resource, "getrusage", lambda who: usage)
    monkeypatch.setattr(sys, "platform", "linux")
    assert bench_memory.rss_mb() is None and bench_memory.peak_rss_mb() == 5.0
    usage.ru_maxrss = 5120 * 1024
    monkeypatch.setattr(sys, "platform", "darwin")
    assert bench_memory.peak_rss_mb() == 5.0


@pytest.mark.parametrize("peaks,tail,flat", [
    ((500.0, 530.0), 0.0, False),          # the peak grew by more than --tolerance_mb
    ((500.0, 490.0), 0.0, True),           # a lower peak: no growth
    ((500.0, 510.0), 0.02, False),         # within tolerance, but a tail slope of 2 MiB per 100
    ((500.0, 510.0), 0.001, True),         # both within
])
def test_bench_memory_verdict_from_peaks_and_tail_slope(peaks, tail, flat, tmp_path, monkeypatch,
                                                        capsys):
    """The verdict from the runs' figures (child processes faked: their JSON lines): growth is
    the longest run's peak RSS minus the shortest's; GROWS (exit 1) when it exceeds
    --tolerance_mb or the longest run's tail slope exceeds --slope_tolerance."""
    import json
    import subprocess
    import bench_memory
    real_run = subprocess.run

    def run(cmd, **kw):
        if "--child" not in cmd:
            return real_run(cmd, **kw)
        n = int(cmd[cmd.index("--stream") + 1].rsplit("_", 1)[1][:-4])
        trace = [400.0 + tail * i for i in range(n)]
        res = {"n": n, "resets": 0, "wer": 0.0, "peak_rss_mb": peaks[n > 2], "end_rss_mb": 400.0,
               "rss_at": {}, "trace": trace, "smaps": {}, "wall_s": 1.0}
        return subprocess.CompletedProcess(cmd, 0, "BENCH_MEMORY " + json.dumps(res) + "\n", "")
    monkeypatch.setattr(bench_memory.subprocess, "run", run)
    monkeypatch.setattr(bench_memory, "make_audio",
                        lambda root, n, *a: [{"ID": i} for i in range(n)])
    js = tmp_path / "mem.json"
    rc = bench_memory.main(["--lengths", "2", "40", "--source", "m", "--window", "10",
                            "--slope_tolerance", "1", "--workdir", str(tmp_path),
                            "--json", str(js)])
    growth = peaks[1] - peaks[0]
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"peak RSS 2 -> 40 utterances: {growth:+.1f} MiB "
                           f"({100 * growth / peaks[0]:+.2f}%); tail slope {100 * tail:+.2f} MiB")
    assert last.split(" -> ")[-1].startswith("FLAT" if flat else "GROWS")
    assert rc == (0 if flat else 1)
    data = json.loads(js.read_text())
    assert data["growth_mb"] == pytest.approx(growth) and data["flat"] is flat
    assert data["results"][1]["tail_slope"] == pytest.approx(100 * tail)


def test_bench_memory_removes_its_temporary_folder(tmp_path, monkeypatch, capsys):
    """Its default work folder was left in /tmp after every run (the streams and runs of each
    length); --workdir keeps them."""
    import bench_memory
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)     # TMPDIR read again
    opts = ["--lengths", "3", "--seconds", "0.5", "0.6",         # one decode child
            "--decode_opts=--steps=1"]
    # one length: no growth; windows of 1 utterance: a tail slope, any slope within tolerance
    assert bench_memory.main([*opts, "--window", "1", "--slope_tolerance", "1e9"]) == 0
    out = capsys.readouterr().out
    assert "3 utts | peak RSS" in out and "tail slope (utterances 2-3)" in out
    assert out.strip().splitlines()[-1].startswith("peak RSS 3 -> 3 utterances: +0.0 MiB")
    assert " -> FLAT (tolerance 20 MiB" in out
    assert not list((tmp_path / "tmp").glob("bench_memory_*"))    # (torch's own caches stay)
    js = tmp_path / "mem.json"
    bench_memory.main(["--lengths", "2", "3", *opts[2:], "--workdir", str(tmp_path / "kept"),
                       "--json", str(js)])
    assert (tmp_path / "kept" / "exp_3" / "summary.json").is_file()
    import json
    data = json.loads(js.read_text())          # growth: the longest run's peak over the shortest
    peaks = [r["peak_rss_mb"] for r in data["results"]]
    assert [r["n"] for r in data["results"]] == [2, 3]
    assert data["growth_mb"] == pytest.approx(peaks[1] - peaks[0])
    assert data["flat"] == (peaks[1] - peaks[0] <= 20.0)


def test_bench_sweep_oracle_resets_fire_at_its_blocks():
    """--reset oracle gave every utterance segment 0: labelled +oracle, it never reset."""
    import bench_sweep
    res = bench_sweep.cpu_bench(2, 6, 1, 0.6, method="csuta", reset="oracle")
    assert res["resets_separate"] == res["resets_batched"] == [2, 2]    # blocks of 2: 0|1|2
    assert res["same_transcripts"]
    assert res["speedup"] == pytest.approx(res["separate_s_per_audio_s"]
                                           / res["batched_s_per_audio_s"])


def test_bench_sweep_says_when_a_batched_run_differs(monkeypatch, capsys):
    """The comparison says so when one batched run's transcripts differ from its separate run's
    (here the last view's, altered); a method without a policy is labelled and printed so."""
    import bench_sweep
    from tta_brain import sweep
    orig = sweep.batch_for

    def batch_for(first):
        cls = orig(first)

        def make(lobe, ms):
            batch = cls(lobe, ms)
            view = batch.views[-1]
            process = view.process
            view.process = lambda w: process(w) + " X"
            return batch
        return make
    monkeypatch.setattr(sweep, "batch_for", batch_for)
    assert bench_sweep.cpu_bench(2, 2, 1, 0.6, method="suta")["same_transcripts"] is False
    out = capsys.readouterr().out
    assert out.startswith("2 suta runs x 2 utterances") and "resets per run" not in out


def test_bench_sweep_runs_differ_in_their_own_setting():
    """Each run of a sweep has its own setting: lr 1e-4 x (r + 1) for the gradient methods, its
    own CMA-ES seed, LAME k or T3A filter for the backprop-free ones."""
    from bench_sweep import FREE, run_setting
    for method in ("suta",) + FREE:
        settings = [run_setting(method, r) for r in range(4)]
        assert len({k for k, _ in settings}) == 1 and len({v for _, v in settings}) == 4
    assert [run_setting("tent", r)[1] for r in range(3)] == pytest.approx([1e-4, 2e-4, 3e-4])


def test_bench_sweep_main_runs_the_options_given(tmp_path, monkeypatch, capsys):
    """main's options reach the runs (R runs of --method, each --steps and lr 1e-4 x (r + 1), the
    fixed reset every max(2, n_utts // 3) utterances) and the figures returned are the JSON's."""
    import json
    import bench_sweep
    from bench_memory import speech_like_wavs
    from tta_brain import methods
    built, orig = [], methods.build_method

    def build_method(name, **kw):
        built.append((name, kw))
        return orig(name, **kw)
    monkeypatch.setattr(methods, "build_method", build_method)
    js = tmp_path / "figures.json"
    res = bench_sweep.main(["--runs", "2", "--n_utts", "3", "--steps", "2", "--seconds", "0.6",
                            "--method", "csuta", "--reset", "fixed", "--json", str(js)])
    assert json.loads(js.read_text()) == res
    assert [res[k] for k in ("runs", "n_utts", "steps", "method", "reset")] == [
        2, 3, 2, "csuta", "fixed"]
    wavs = speech_like_wavs(3, 0.9 * 0.6, 1.1 * 0.6, seed=3)
    assert res["audio_s"] == pytest.approx(sum(w.numel() for w in wavs) / 16000)
    assert len(built) == 5 and {name for name, _ in built} == {"csuta"}   # warm-up, 2 + 2
    assert all(kw["steps"] == 2 and kw["reset_policy"].every == 2 for _, kw in built)
    assert [kw["lr"] for _, kw in built[1:]] == pytest.approx([1e-4, 2e-4, 1e-4, 2e-4])
    assert capsys.readouterr().out.startswith("2 csuta+fixed runs x 3 utterances (")


def test_bench_sweep_dynamic_reset_and_threads_reach_the_runs(monkeypatch, capsys):
    """--reset dynamic builds every run's policy with K = max(4, n_utts // 3) (here 4 of 5
    utterances: phi_D at 2, the LII of utterances 2 and 3 make its Gaussian, 4 is tested) and
    --threads sets torch's CPU threads before the first run is built (both printed; the test
    then runs on one thread: two are slow on a busy machine)."""
    import torch
    import bench_sweep
    from tta_brain import methods
    built, orig = [], methods.build_method

    def build_method(name, **kw):
        built.append((orig(name, **kw), torch.get_num_threads()))
        torch.set_num_threads(1)
        return built[-1][0]
    monkeypatch.setattr(methods, "build_method", build_method)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = bench_sweep.main(["--runs", "2", "--n_utts", "5", "--steps", "1", "--seconds",
                                "0.3", "--method", "csuta", "--reset", "dynamic",
                                "--threads", "2"])
    finally:
        torch.set_num_threads(threads)
    assert len(built) == 5 and built[0][1] == 2                    # warm-up, 2 + 2
    assert all(m.reset_policy.name == "dynamic" and m.reset_policy.K == 4 for m, _ in built)
    for m, _ in built[1:3]:                                         # the separate runs
        assert [(e.kind, e.position, e.reason) for e in m.events] == [
            ("lii", 2, "construction"), ("lii", 3, "construction"), ("lii", 4, "detection")]
    assert res["reset"] == "dynamic" and res["resets_separate"] == res["resets_batched"]
    out = capsys.readouterr().out
    assert out.startswith("2 csuta+dynamic runs x 5 utterances (") and " 2 thread(s): " in out

    class Built(Exception):
        """Stops the benchmark at its first build (15 utterances: K = 5, not 4)."""

    def first_build(name, **kw):
        raise Built(kw["reset_policy"].K)
    monkeypatch.setattr(methods, "build_method", first_build)
    with pytest.raises(Built) as e:
        bench_sweep.main(["--n_utts", "15", "--method", "csuta", "--reset", "dynamic"])
    assert e.value.args == (5,)


def test_bench_sweep_counts_the_batched_runs_own_resets(monkeypatch, capsys):
    """The batched runs' resets are counted from the batch's views, not copied from the separate
    runs: here the last view's oracle policy is dropped, so it never resets."""
    import bench_sweep
    from tta_brain import sweep
    orig = sweep.batch_for

    def batch_for(first):
        cls = orig(first)

        def make(lobe, ms):
            batch = cls(lobe, ms)
            batch.views[-1].reset_policy = None
            return batch
        return make
    monkeypatch.setattr(sweep, "batch_for", batch_for)
    res = bench_sweep.cpu_bench(2, 6, 1, 0.6, method="csuta", reset="oracle")
    assert (res["resets_separate"], res["resets_batched"]) == ([2, 2], [2, 0])
    assert capsys.readouterr().out.rstrip().endswith("resets per run [2, 2] (batched [2, 0])")


def test_bench_speed_says_a_bad_stream_in_one_line(tmp_path):
    """A manifest that needs --data_root (or names a missing file) was ManifestError's traceback."""
    import bench_speed
    csv = tmp_path / "s.csv"
    csv.write_text("ID,duration,wav,wrd\nu1,1.0,$data_root/u1.wav,A\n")
    with pytest.raises(SystemExit) as e:
        bench_speed.csv_stream(str(csv), "", 1)
    assert str(e.value).startswith(f"ERROR: --stream {csv}: ") and "data_root" in str(e.value)
    with pytest.raises(SystemExit) as e:
        bench_speed.csv_stream(str(csv), str(tmp_path), 1)
    assert str(e.value) == f"ERROR: --stream {csv}: {tmp_path / 'u1.wav'}: file not found"
