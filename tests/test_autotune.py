"""The autotuner: keys, buckets, pruning, the on-disk cache, the env switch (CPU, fake timer and device), and one
GPU test that tunes the real probe kernel and reuses the cache from a second process."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

from vbw_cupy import autotune as at

REPO = pathlib.Path(__file__).resolve().parents[1]
FAKE_DEVICE = {"id": 0, "name": "Fake GPU X", "arch": 90, "nvrtc": "12.8",
               "limits": {"arch": 90, "smem_optin": 227 * 1024, "smem_per_sm": 228 * 1024, "max_threads": 1024,
                          "regs_per_block": 65536, "num_sms": 132, "l2_bytes": 50 << 20}}
DEFAULTS = {80: {"BM": 64, "W": 4}, 86: {"BM": 64, "W": 2}, 89: {"BM": 128, "W": 2}, 90: {"BM": 128, "W": 4}}
CANDS = tuple({"BM": m, "W": w} for m in (32, 64, 128, 256) for w in (2, 4, 8))


def fake_ms(cfg):
    # a smooth landscape with its minimum at BM=64, W=4 (not any arch's default)
    return 1.0 + abs(cfg["BM"] - 64) / 64 + abs(cfg["W"] - 4) / 4


class Timer:
    def __init__(self, fn=fake_ms, fail=()):
        self.calls, self.fn, self.fail, self.kw = [], fn, fail, []

    def __call__(self, run, cfg, **kw):
        self.calls.append(dict(cfg))
        self.kw.append(kw)
        run(cfg)
        if cfg in self.fail:
            raise RuntimeError(f"cudaErrorLaunchOutOfResources for {cfg}")
        return self.fn(cfg)


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "1")
    monkeypatch.setattr(at, "_device_info", lambda: FAKE_DEVICE)
    timer = Timer()
    monkeypatch.setattr(at, "_timer", timer)
    at.reset()
    at.register(at.Tunable(name="t_fake", params=("BM", "W"), candidates=CANDS, defaults=DEFAULTS,
                           bucket=lambda s: (at.pow2_bucket(s["M"], lo=16, hi=4096), s["K"]),
                           fits=lambda c, lim: c["BM"] * c["W"] * 256 <= lim["smem_optin"],
                           source="autotune_probe.cu"))
    yield timer
    at._registry.pop("t_fake", None)
    at.reset()


def noop(cfg):
    pass


def test_pow2_bucket():
    assert [at.pow2_bucket(n) for n in (0, 1, 2, 3, 4, 5, 1000, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert at.pow2_bucket(3, lo=16) == 16 and at.pow2_bucket(100000, hi=8192) == 8192


def test_tunable_validates_configs():
    with pytest.raises(ValueError, match="must set exactly"):
        at.Tunable(name="bad", params=("A",), candidates=({"A": 1, "B": 2},), defaults={80: {"A": 1}},
                   bucket=lambda s: ())
    with pytest.raises(ValueError, match="defaults"):
        at.Tunable(name="bad", params=("A",), candidates=(), defaults={}, bucket=lambda s: ())
    with pytest.raises(KeyError, match="no Tunable named 'nope'"):
        at.get("nope")


def test_key_construction(env):
    k = at.make_key("t_fake", {"M": 1000, "K": 512}, "float16")
    name, src, dev, arch, nvrtc, dtype, bucket = k.split("|")
    assert (name, dev, arch, nvrtc, dtype, bucket) == ("t_fake", "Fake GPU X", "sm_90", "nvrtc12.8", "float16",
                                                       "1024,512")
    assert src == at.rt.source_hash("autotune_probe.cu") and len(src) == 16
    # same bucket -> same key; anything else in the key -> a different key
    assert at.make_key("t_fake", {"M": 1020, "K": 512}, "float16") == k
    others = {at.make_key("t_fake", {"M": 1025, "K": 512}, "float16"),
              at.make_key("t_fake", {"M": 1000, "K": 256}, "float16"),
              at.make_key("t_fake", {"M": 1000, "K": 512}, "bfloat16"),
              at.make_key("t_fake", {"M": 1000, "K": 512}, "float16", {**FAKE_DEVICE, "arch": 80}),
              at.make_key("t_fake", {"M": 1000, "K": 512}, "float16", {**FAKE_DEVICE, "name": "Other"}),
              at.make_key("t_fake", {"M": 1000, "K": 512}, "float16", {**FAKE_DEVICE, "nvrtc": "13.0"})}
    assert k not in others and len(others) == 6
    import ml_dtypes
    assert at.make_key("t_fake", {"M": 8, "K": 8}, ml_dtypes.bfloat16).split("|")[5] == "bfloat16"


def test_source_hash_follows_the_file_and_headers(tmp_path, monkeypatch):
    monkeypatch.setattr(at.rt, "SOURCE_DIR", tmp_path)
    monkeypatch.setattr(at.rt, "_src_hashes", {})
    (tmp_path / "a.cu").write_text("kernel a v1")
    (tmp_path / "b.cu").write_text("kernel b")
    h1, hb = at.rt.source_hash("a.cu"), at.rt.source_hash("b.cu")
    monkeypatch.setattr(at.rt, "_src_hashes", {})
    (tmp_path / "a.cu").write_text("kernel a v2")
    h2, hb2 = at.rt.source_hash("a.cu"), at.rt.source_hash("b.cu")
    assert h1 != h2 and hb == hb2           # editing a.cu leaves b's tuning valid
    monkeypatch.setattr(at.rt, "_src_hashes", {})
    (tmp_path / "common.cuh").write_text("shared")
    assert at.rt.source_hash("a.cu") != h2 and at.rt.source_hash("b.cu") != hb2   # a header edit invalidates all
    # a tunable whose kernels live in two files hashes both: an edit to either invalidates its tuning
    monkeypatch.setattr(at.rt, "_src_hashes", {})
    hab = at.rt.source_hash(("a.cu", "b.cu"))
    assert hab not in (at.rt.source_hash("a.cu"), at.rt.source_hash("b.cu"))
    monkeypatch.setattr(at.rt, "_src_hashes", {})
    (tmp_path / "b.cu").write_text("kernel b v2")
    assert at.rt.source_hash(("a.cu", "b.cu")) != hab


def test_arch_fallback_to_nearest(env):
    for arch, want in ((80, 80), (86, 86), (87, 86), (89, 89), (90, 90), (100, 90), (120, 90), (75, 80), (70, 80)):
        assert at.default_config("t_fake", arch) == DEFAULTS[want], arch
    assert at.default_config("t_fake") == DEFAULTS[90]   # the (fake) current device
    cfg = at.default_config("t_fake", 90)
    cfg["BM"] = -1                                      # callers get a copy
    assert at.default_config("t_fake", 90) == DEFAULTS[90]


def test_tunes_with_pruning_and_default_first(env):
    timer = env
    cfg = at.pick("t_fake", {"M": 1000, "K": 512}, "float16", noop)
    assert cfg == {"BM": 64, "W": 4}
    fitting = [c for c in CANDS if c["BM"] * c["W"] * 256 <= FAKE_DEVICE["limits"]["smem_optin"]]
    assert len(fitting) < len(CANDS)                    # the fits rule prunes something here
    sweep, confirm = timer.calls[:len(fitting)], timer.calls[len(fitting):]
    assert sweep[0] == DEFAULTS[90]                     # default is timed first
    assert sorted(map(str, sweep)) == sorted(map(str, fitting))
    # then the winner is confirmed against the default, alternately
    assert confirm == [DEFAULTS[90], {"BM": 64, "W": 4}] * at.CONFIRM_ROUNDS
    assert all(kw["budget_s"] > 0 for kw in timer.kw)
    assert timer.kw[0]["cutoff_ms"] is None and timer.kw[1]["cutoff_ms"] == pytest.approx(3 * fake_ms(DEFAULTS[90]))
    s = at.stats()
    n_calls = len(fitting) + 2 * at.CONFIRM_ROUNDS
    assert s["tuned"] == 1 and s["timer_calls"] == n_calls
    # the same bucket is a memory hit: no more timing
    assert at.pick("t_fake", {"M": 1023, "K": 512}, "float16", noop) == cfg
    assert len(timer.calls) == n_calls and at.stats()["memory_hits"] == 1


def test_a_lucky_sweep_winner_is_not_kept(env):
    lucky = {"BM": 32, "W": 8}
    seen = []

    def once_fast(cfg):  # the sweep measures `lucky` fast once; re-timing shows it is not
        seen.append(cfg == lucky)
        return 0.5 if cfg == lucky and seen.count(True) == 1 else 1.0 + (cfg != DEFAULTS[90])
    env.fn = once_fast
    assert at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop) == DEFAULTS[90]


def test_fits_receives_device_limits(env, monkeypatch):
    seen = []
    t = at.get("t_fake")
    at.register(at.Tunable(name="t_fake", params=t.params, candidates=t.candidates, defaults=t.defaults,
                           bucket=t.bucket, fits=lambda c, lim: seen.append(lim) or c["W"] == 2))
    at.pick("t_fake", {"M": 64, "K": 64}, "float32", noop)
    assert seen and seen[0] == FAKE_DEVICE["limits"]
    assert all(c["W"] == 2 for c in env.calls)


def test_failing_candidate_scored_unusable(env, monkeypatch):
    best = {"BM": 64, "W": 4}
    timer = Timer(fail=(best,))
    monkeypatch.setattr(at, "_timer", timer)
    cfg = at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)
    assert best in timer.calls and cfg != best
    assert fake_ms(cfg) == min(fake_ms(c) for c in timer.calls if c != best)
    assert at.stats()["failed"] == 1
    entry = json.loads(at.cache_path().read_text())["entries"][at.make_key("t_fake", {"M": 64, "K": 64}, "float16")]
    assert entry["failed"] == 1 and entry["config"] == cfg


def test_a_fitting_candidate_that_raises_in_run_or_fits(env, monkeypatch):
    def run(cfg):
        if cfg["BM"] == 256:
            raise ValueError("BM=256 unsupported")      # e.g. NVRTC CompileError raised by the launch
    t = at.get("t_fake")
    at.register(at.Tunable(name="t_fake", params=t.params, candidates=t.candidates, defaults=t.defaults,
                           bucket=t.bucket, fits=lambda c, lim: 1 // (c["BM"] - 32) >= 0))  # fits raises at 32
    monkeypatch.setattr(at, "_timer", Timer(fn=lambda c: 10.0 - c["BM"] / 64))  # BM=256 would win
    cfg = at.pick("t_fake", {"M": 64, "K": 64}, "float16", run)
    assert cfg["BM"] == 128


def test_all_candidates_failing_falls_back_to_default(env, monkeypatch):
    monkeypatch.setattr(at, "_timer", Timer(fail=CANDS))
    with pytest.warns(RuntimeWarning, match="every candidate"):
        cfg = at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)
    assert cfg == DEFAULTS[90]
    assert not at.cache_path().exists()                # a total failure is not remembered on disk
    assert at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop) == DEFAULTS[90]   # nor re-timed here


def test_sticky_cuda_error_is_reraised(env, monkeypatch):
    class CUDARuntimeError(RuntimeError):
        status = 700

    def timer(run, cfg, **kw):
        raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    monkeypatch.setattr(at, "_timer", timer)
    with pytest.raises(RuntimeError, match="sticky CUDA error"):
        at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)


def test_env_switch_off_uses_defaults_without_timing(env, monkeypatch):
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "0")
    for arch in (80, 86, 89, 90, 100):
        monkeypatch.setattr(at, "_device_info", lambda arch=arch: {**FAKE_DEVICE, "arch": arch})
        assert at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop) == DEFAULTS[min(arch, 90)]
    assert env.calls == [] and not at.cache_path().exists()
    assert at.stats()["defaults"] == 5
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "1")
    assert at.enabled()
    at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)
    assert env.calls


def test_cache_round_trip_across_reload(env, monkeypatch):
    cfg = at.pick("t_fake", {"M": 300, "K": 128}, "float16", noop)
    data = json.loads(at.cache_path().read_text())
    assert data["meta"]["format"] == at.FORMAT_VERSION and data["meta"]["tool"] == "vbw_cupy.autotune"
    assert "vbw_cupy" in data["meta"]
    (key, entry), = data["entries"].items()
    assert entry["config"] == cfg and entry["default"] == DEFAULTS[90] and entry["default_ms"] == fake_ms(DEFAULTS[90])
    at.reset()                                         # a new process: memory empty, the file stays

    def no_timer(*a, **k):
        raise AssertionError("timed on a cache hit")
    monkeypatch.setattr(at, "_timer", no_timer)
    assert at.pick("t_fake", {"M": 300, "K": 128}, "float16", noop) == cfg
    assert at.stats()["disk_hits"] == 1 and at.stats()["timer_calls"] == 0
    # a key another process wrote after this one loaded the file is still found (re-read on a miss)
    other = at.make_key("t_fake", {"M": 5000, "K": 128}, "float16")
    at._store(other, {**entry, "config": {"BM": 32, "W": 2}}, "t_fake")
    at._memory.pop(other)
    assert at.pick("t_fake", {"M": 5000, "K": 128}, "float16", noop) == {"BM": 32, "W": 2}


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe garbage", b"[1, 2, 3]",
                                     json.dumps({"meta": {"tool": "someone.else"}, "entries": {}}).encode(),
                                     json.dumps({"meta": {"tool": "vbw_cupy.autotune", "format": 0},
                                                 "entries": {}}).encode(),
                                     json.dumps({"meta": {"tool": "vbw_cupy.autotune", "format": 1},
                                                 "entries": {"k": {"config": {"BM": 64}}}})[:-7].encode(),
                                     b"", b"\0" * 100],
                         ids=["corrupt", "binary", "foreign-list", "foreign-tool", "stale-format", "truncated",
                              "empty", "zeros"])
def test_bad_cache_file_one_warning_then_rewritten(env, content):
    at.cache_path().parent.mkdir(parents=True)
    at.cache_path().write_bytes(content)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)
        at._memory.clear()                             # force more reads of the file in this process
        at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)
        at.pick("t_fake", {"M": 4096, "K": 64}, "float16", noop)
        at.cache_summary()                             # info never warns
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "ignoring the tuning cache" in msgs[0] and "rewritten" in msgs[0], msgs
    data = json.loads(at.cache_path().read_text())     # rewritten, valid, holds both keys
    assert data["meta"]["format"] == at.FORMAT_VERSION and len(data["entries"]) == 2
    assert a == {"BM": 64, "W": 4}


def test_unwritable_cache_dir_degrades_to_memory(env, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(blocker / "sub"))
    with pytest.warns(RuntimeWarning, match="cannot write the tuning cache"):
        cfg = at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)
    n = len(env.calls)
    assert at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop) == cfg and len(env.calls) == n


_WRITER = textwrap.dedent("""
    import os, sys, time
    from vbw_cupy import autotune as at
    tag, n = sys.argv[1], int(sys.argv[2])
    open(f"ready_{tag}", "w").close()
    while not os.path.exists("go"):                   # start both writers together
        time.sleep(0.001)
    for i in range(n):
        at._memory.clear()
        at._store(f"k|{tag}|{i}", {"kernel": "k", "config": {"i": i, "tag": tag}, "ms": 1.0}, "k")
""")


def test_concurrent_writers_keep_both(env, tmp_path):
    envv = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, tag, str(n)], env=envv, cwd=str(tmp_path))
             for tag in ("a", "b")]
    for _ in range(6000):
        if all((tmp_path / f"ready_{t}").exists() for t in "ab") or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    entries = json.loads(at.cache_path().read_text())["entries"]
    assert set(entries) == {f"k|{t}|{i}" for t in "ab" for i in range(n)}
    assert not list(at.cache_path().parent.glob("*.tmp"))   # no temp files left behind


def test_tune_ahead_of_time_and_table(env, monkeypatch):
    built = []

    def bench(shape, dtype):
        built.append((shape, dtype))
        return noop
    t = at.get("t_fake")
    at.register(at.Tunable(name="t_fake", params=t.params, candidates=t.candidates, defaults=t.defaults,
                           bucket=t.bucket, fits=t.fits, bench=bench,
                           standard_shapes=(({"M": 128, "K": 64}, "float16"), ({"M": 4096, "K": 64}, "bfloat16"))))
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "0")        # tune() tunes even when pick would not
    monkeypatch.setattr(at, "_import_kernel_modules", lambda: None)
    rows = at.tune(["t_fake"], progress=False)
    assert [(r["kernel"], r["bucket"], r["dtype"], r["cached"]) for r in rows] == [
        ("t_fake", "128,64", "float16", False), ("t_fake", "4096,64", "bfloat16", False)]
    r = rows[0]
    assert r["chosen"] == {"BM": 64, "W": 4} and r["default"] == DEFAULTS[90]
    assert r["chosen_ms"] == fake_ms(r["chosen"]) and r["speedup"] == pytest.approx(r["default_ms"] / r["chosen_ms"])
    assert len(built) == 2
    rows2 = at.tune(["t_fake"], progress=False)         # second time: all from the cache, nothing built
    assert all(r["cached"] for r in rows2) and len(built) == 2
    rows3 = at.tune(["t_fake"], shapes={"t_fake": [({"M": 16, "K": 8}, "float32")]}, progress=True, force=True)
    assert len(rows3) == 1 and rows3[0]["bucket"] == "16,8"
    table = at.format_rows(rows + rows3)
    import io
    buf = io.StringIO()
    at.print_tune_table(rows + rows3, out=buf)
    assert buf.getvalue().strip() == table
    assert "t_fake" in table and "BM=64 W=4" in table and "gain" in table.splitlines()[0]
    s = at.cache_summary()
    assert s["status"] == "ok" and s["entries"] == 3 and s["path"] == str(at.cache_path())
    assert {r["kernel"] for r in s["rows"]} == {"t_fake"} and all(r["config"] for r in s["rows"])


def test_cache_summary_without_a_file(env):
    s = at.cache_summary()
    assert s["status"] == "missing" and s["entries"] == 0 and s["rows"] == []


def test_probe_kernel_instances_listed():
    inst = at.kernel_instances()
    t = at.probe_tunable()
    assert {(at.PROBE_SOURCE, f"probe_axpb<{c['BLOCK']}, {c['VEC']}>") for c in t.candidates} | {
        (at.PROBE_SOURCE, "l2_flush_read")} == set(inst)
    assert (REPO / "cuda_src" / at.PROBE_SOURCE).is_file()


# ------------------------------------------------------------------------------------------------------ GPU
_SECOND = textwrap.dedent("""
    import json, time
    import cupy as cp
    from vbw_cupy import autotune as at
    t = at.probe_tunable()
    n = 1 << 25
    x = cp.arange(n, dtype=cp.float32); y = cp.empty_like(x)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    cfg = at.pick("autotune_probe", {"n": n}, "float32", lambda c: at.probe_launch(c, x, y))
    pick_ms = (time.perf_counter() - t0) * 1e3
    print(json.dumps({"cfg": cfg, "stats": at.stats(), "pick_ms": pick_ms}))
""")


@pytest.mark.gpu
def test_gpu_probe_tuning_beats_default_and_is_reused(tmp_path, monkeypatch):
    import cupy as cp
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "1")
    at.reset()
    at.probe_tunable()
    n = 1 << 25
    x = cp.arange(n, dtype=cp.float32)
    y = cp.full_like(x, cp.nan)
    run = lambda c: at.probe_launch(c, x, y)
    t0 = time.perf_counter()
    cfg = at.pick("autotune_probe", {"n": n}, "float32", run)
    tune_s = time.perf_counter() - t0
    s = at.stats()
    # the sweep, the candidates cut off while compiles ran (timed again), the confirmation when a non-default wins
    n_timed = len(at.get("autotune_probe").candidates) + s["retimed"]
    assert s["tuned"] == 1 and s["timer_calls"] in (n_timed, n_timed + 2 * at.CONFIRM_ROUNDS), s
    assert 0 <= s["retimed"] < len(at.get("autotune_probe").candidates), s
    assert s["failed"] == 0
    probe_instances = {(c["BLOCK"], c["VEC"]) for c in at.get("autotune_probe").candidates}
    # every candidate compiled up front, together, with the timer's L2 flush kernel (unless a test before this
    # one in the process loaded it)
    assert s["compiled"] in (len(probe_instances), len(probe_instances) + 1), s
    assert tune_s < 60, tune_s                       # includes NVRTC compiles of 20 instances
    cp.testing.assert_allclose(y, 2.0 * x + 1.0, rtol=1e-6)   # every element written, correct
    default = at.default_config("autotune_probe")
    ms = {"default": [], "chosen": []}
    for _ in range(3):                               # interleaved, independent of the tuner's own numbers
        ms["default"].append(at._cuda_event_timer(run, default, budget_s=0.2))
        ms["chosen"].append(at._cuda_event_timer(run, cfg, budget_s=0.2))
    d, c = min(ms["default"]), min(ms["chosen"])
    print(f"\nprobe n=2^25: default {default} {d:.4f} ms, chosen {cfg} {c:.4f} ms, tuning {tune_s:.2f} s")
    assert c <= 1.05 * d, (ms, cfg)
    # a second process reuses the cache: no timer call, the same config, and picking is cheap
    envv = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", _SECOND], env=envv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"second process: {res}")
    assert res["cfg"] == cfg and res["stats"]["timer_calls"] == 0 and res["stats"]["disk_hits"] == 1
    assert res["pick_ms"] < 100, res


@pytest.mark.gpu
def test_gpu_unlaunchable_candidate_is_unusable_not_a_crash(tmp_path, monkeypatch):
    import cupy as cp
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "1")
    at.reset()
    at.register(at.Tunable(name="autotune_probe_bad", params=("BLOCK", "VEC"),
                           candidates=({"BLOCK": 2048, "VEC": 1}, {"BLOCK": 256, "VEC": 4}),
                           defaults={80: {"BLOCK": 128, "VEC": 1}}, bucket=lambda s: (s["n"],),
                           source=at.PROBE_SOURCE))   # no fits: 2048 threads must fail at launch
    try:
        n = 1 << 20
        x = cp.arange(n, dtype=cp.float32)
        y = cp.empty_like(x)
        cfg = at.pick("autotune_probe_bad", {"n": n}, "float32", lambda c: at.probe_launch(c, x, y))
        assert cfg["BLOCK"] != 2048 and at.stats()["failed"] == 1
        at.probe_launch(cfg, x, y)                   # the context is still healthy
        cp.testing.assert_allclose(y, 2.0 * x + 1.0, rtol=1e-6)
    finally:
        at._registry.pop("autotune_probe_bad", None)


def test_candidates_are_timed_as_their_kernels_compile(env, monkeypatch):
    """pick runs each candidate once under rt.collecting(), compiles what it asked for on a pool of threads,
    runs it again for a kernel it reaches only after its first (here: a shared second kernel), and times each
    candidate once its kernels are there, the default first, while slower kernels still compile (here one
    kernel's compile waits until a candidate has been timed: without the overlap it would time out). A
    candidate that fails otherwise is left to the timing."""
    import threading
    from vbw_cupy import _runtime as rt
    compiled, asked, lock = set(), [], threading.Lock()
    slow, timed_one, overlapped = "main<32, 2>", threading.Event(), []

    def kernel(name):
        if rt._collect.__dict__.get("on"):
            if name not in compiled:
                raise rt.NeedsCompile(("probe.cu", name, 90, ()))
        else:
            assert name in compiled, f"{name} launched for timing before it compiled"

    def run(c):
        if c["BM"] == 256:
            raise RuntimeError("cudaErrorLaunchOutOfResources")  # never compiles anything
        kernel(f"main<{c['BM']}, {c['W']}>")
        kernel("reduce")

    def compile_one(job):
        if job[1] == slow:
            overlapped.append(timed_one.wait(timeout=10))
        with lock:
            asked.append(job[1])
            compiled.add(job[1])
        return job, None

    timer = env.__call__

    def timing(run_, cfg, **kw):
        out = timer(run_, cfg, **kw)
        timed_one.set()
        return out
    monkeypatch.setattr(at, "_timer", timing)
    monkeypatch.setattr(rt, "_compile_one", compile_one)
    monkeypatch.setattr(at, "_compile_workers", lambda: 4)   # the slow compile holds one of them
    at.pick("t_fake", {"M": 64, "K": 128}, "float16", run)
    fitting = [c for c in CANDS if c["BM"] * c["W"] * 256 <= FAKE_DEVICE["limits"]["smem_optin"] and c["BM"] != 256]
    assert sorted(asked) == sorted([f"main<{c['BM']}, {c['W']}>" for c in fitting] + ["reduce"])   # each once
    assert overlapped == [True]                   # a candidate was timed while the slow kernel compiled
    assert env.calls[0] == DEFAULTS[90]           # the default first
    sweep = env.calls[:len(fitting) + 1]
    assert {"BM": 32, "W": 2} in sweep and sweep.index({"BM": 32, "W": 2}) > 1
    assert at.stats()["compiled"] == len(fitting) + 1 and at.stats()["failed"] >= 1


def test_candidate_compile_stops_when_nothing_is_kept(env, monkeypatch):
    """A cache that cannot keep what was compiled (a read-only directory) asks for the same kernel again: the
    candidates are timed then (the timing compiles it), and the kernel is compiled once."""
    from vbw_cupy import _runtime as rt
    asked = []

    def run(c):
        if rt._collect.__dict__.get("on"):
            raise rt.NeedsCompile(("probe.cu", "k", 90, ()))

    monkeypatch.setattr(rt, "_compile_one", lambda job: asked.append(job) or (job, None))
    at.pick("t_fake", {"M": 64, "K": 128}, "float16", run)
    assert len(asked) == 1 and env.calls


def _replace_cached_config(env, config, **others):
    """Overwrite the config of the cache file's one entry (and add `others` beside it), then start over as a new
    process would, with the fake timer's calls cleared."""
    data = json.loads(at.cache_path().read_text())
    (key, entry), = data["entries"].items()
    entry["config"] = config
    data["entries"].update(others)
    at.cache_path().write_text(json.dumps(data))
    at.reset()
    env.calls.clear()


def test_cached_config_this_version_does_not_declare_is_retuned(env):
    shape = {"M": 256, "K": 64}
    at.pick("t_fake", shape, "float16", noop)
    _replace_cached_config(env, {"BM": 999, "W": 4})  # e.g. a tile removed from the candidate table since it was tuned
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = at.pick("t_fake", shape, "float16", noop)
    assert cfg in CANDS and cfg == {"BM": 64, "W": 4} and env.calls  # re-tuned, not handed the stale tile
    assert sum("does not declare it" in str(x.message) for x in w) == 1


def test_cached_config_that_does_not_fit_the_device_is_retuned(env):
    """A declared candidate written into the cache by hand (or by a machine with more shared memory) that does
    not fit this device is never launched: one warning, then the tuner runs as on a miss."""
    shape = {"M": 256, "K": 64}
    at.pick("t_fake", shape, "float16", noop)
    _replace_cached_config(env, {"BM": 256, "W": 8})   # declared, but 256 * 8 * 256 bytes > 227 KB
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = at.pick("t_fake", shape, "float16", noop)
    assert cfg == {"BM": 64, "W": 4} and env.calls and {"BM": 256, "W": 8} not in env.calls
    assert sum("does not fit this device" in str(x.message) for x in w) == 1


def test_pick_shortcut_forgets_a_replaced_tunable(env):
    """A re-registered Tunable (module reload, edited tables) is asked again: pick's per-shape shortcut must not
    hand back a config the new one no longer declares."""
    shape = {"M": 100, "K": 64}
    t = at.get("t_fake")
    make = lambda cands: at.register(at.Tunable(name="t_fake", params=t.params, candidates=cands,  # noqa: E731
                                                defaults={90: DEFAULTS[90]}, bucket=t.bucket, fits=t.fits,
                                                source=t.source))
    make(CANDS)
    first = at.pick("t_fake", shape, "float16", noop)
    assert first == {"BM": 64, "W": 4} and first != DEFAULTS[90]
    gen = at._generation
    make(tuple(c for c in CANDS if c != first))
    assert at._generation > gen
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = at.pick("t_fake", shape, "float16", noop)
    assert again != first and again in at.get("t_fake").candidates + (DEFAULTS[90],)


def test_pick_shortcut_is_bounded(env, monkeypatch):
    monkeypatch.setattr(at, "_MAX_PICKED", 50)
    for m in range(16, 400):  # one bucket per power of two: few tunings, many exact shapes
        at.pick("t_fake", {"M": m, "K": 64}, "float16", noop)
    assert 1 <= len(at._picked) <= 50
    assert at.pick("t_fake", {"M": 399, "K": 64}, "float16", noop) == at.pick("t_fake", {"M": 300, "K": 64},
                                                                               "float16", noop)


@pytest.mark.parametrize("bad", [{"BM": 64.0, "W": 4}, {"BM": 64, "W": 4.0}, {"BM": True, "W": 4}, {"BM": "64", "W": 4},
                                 {"BM": 64}, {"BM": 64, "W": 4, "X": 1}, {"BM": None, "W": 4}, [64, 4], "BM=64",
                                 None, 64],
                         ids=["float", "float2", "bool", "str", "missing", "extra", "null", "list", "string", "none",
                              "int"])
def test_cached_config_of_the_wrong_type_is_never_used(env, bad):
    """64.0 == 64 in Python, so a config compared by value alone would reach a kernel name as "64.0": a cached
    config must name a declared one with the same types; pick hands back the declared dict, never the file's."""
    shape = {"M": 256, "K": 64}
    good = at.pick("t_fake", shape, "float16", noop)
    _replace_cached_config(env, bad, **{"other|key": "garbage"})   # a non-entry beside it is skipped, not fatal
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = at.pick("t_fake", shape, "float16", noop)
        again = at.pick("t_fake", {"M": 250, "K": 64}, "float16", noop)   # same bucket: no second warning
    assert cfg == again == good and env.calls                              # re-tuned
    assert all(type(v) is int for v in cfg.values())
    assert sum("does not declare it" in str(x.message) for x in w) == 1, [str(x.message) for x in w]
    assert at.cache_summary()["entries"] == 1


def test_cached_config_is_the_declared_dict(env):
    """Even a valid cached config is replaced by the Tunable's own dict (the file's is never passed on)."""
    shape = {"M": 256, "K": 64}
    at.pick("t_fake", shape, "float16", noop)
    at.reset()
    cfg = at.pick("t_fake", shape, "float16", noop)
    assert cfg in CANDS and all(type(v) is int for v in cfg.values()) and at.stats()["disk_hits"] == 1


def test_cache_dir_that_is_a_file(env, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(blocker))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cfg = at.pick("t_fake", {"M": 64, "K": 64}, "float16", noop)
        at.pick("t_fake", {"M": 4096, "K": 64}, "float16", noop)
    msgs = [str(x.message) for x in w]
    assert cfg == {"BM": 64, "W": 4} and len(msgs) == 1 and "cannot write the tuning cache" in msgs[0], msgs
    assert at.cache_summary()["status"] == "missing" and blocker.read_text() == "x"


def test_slow_tuning_prints_a_notice_fast_tuning_none(env, monkeypatch, capsys):
    from vbw_cupy import _progress
    at.pick("t_fake", {"M": 1000, "K": 512}, "float16", noop)
    assert "tuning" not in capsys.readouterr().err
    monkeypatch.setattr(_progress, "AFTER_S", 0.05)
    env.fn = lambda cfg: time.sleep(0.01) or fake_ms(cfg)
    at.pick("t_fake", {"M": 64, "K": 512}, "float16", noop)
    err = capsys.readouterr().err
    assert "vbw_cupy: tuning t_fake for" in err and "done in" in err


def test_candidate_whose_kernel_fails_to_compile_is_scored_without_recompiling(env, monkeypatch):
    """A kernel that fails to compile is compiled once: its candidates are scored as failed and never timed
    (the timing would compile it again), and no later round asks for it again."""
    import threading
    from vbw_cupy import _runtime as rt
    compiled, asked, lock = set(), [], threading.Lock()

    def run(c):
        name = "broken" if c["BM"] == 64 else f"k<{c['BM']}, {c['W']}>"
        if rt._collect.__dict__.get("on") and name not in compiled:
            raise rt.NeedsCompile(("probe.cu", name, 90, ()))
        assert name != "broken", "a kernel that failed to compile was launched"

    def compile_one(job):
        with lock:
            asked.append(job[1])
            if job[1] != "broken":
                compiled.add(job[1])
        return job, ("CompileError: error: expected a ';'" if job[1] == "broken" else None)

    monkeypatch.setattr(rt, "_compile_one", compile_one)
    cfg = at.pick("t_fake", {"M": 64, "K": 128}, "float16", run)
    assert cfg["BM"] != 64 and asked.count("broken") == 1 and len(asked) == len(set(asked))
    assert env.calls and all(c["BM"] != 64 for c in env.calls)
    assert at.stats()["failed"] == sum(1 for c in CANDS if c["BM"] == 64
                                       and c["BM"] * c["W"] * 256 <= FAKE_DEVICE["limits"]["smem_optin"])


def test_candidate_compile_falls_back_to_one_thread(env, monkeypatch):
    """Compile threads that cannot start (not a kernel's fault) leave the kernels to be compiled one by one."""
    import threading
    from vbw_cupy import _runtime as rt
    done = []

    def run(c):
        if rt._collect.__dict__.get("on") and "k" not in done:
            raise rt.NeedsCompile(("probe.cu", "k", 90, ()))

    real_start = threading.Thread.start

    def start(self):
        if self.name == "vbw_cupy-nvrtc":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    monkeypatch.setattr(rt, "_compile_one", lambda job: done.append(job[1]) or (job, None))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        at.pick("t_fake", {"M": 64, "K": 128}, "float16", run)
    assert done == ["k"] and any("one kernel at a time" in str(x.message) for x in w)
    assert env.calls


def test_odd_cache_files_and_shapes(tmp_path, monkeypatch):
    # a JSON file nested past Python's recursion limit crashed info and pick(); a 400-digit ms crashed info;
    # NumPy ints in a shape lost the tuning result (not JSON-serializable)
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path))
    at.cache_path().write_text("[" * 100000 + "]" * 100000)
    assert at._read_file(at.cache_path()) == ({}, "corrupt (not valid JSON)")
    assert at._ms_or_none(10 ** 400) is None and at._ms_or_none(2) == 2.0 and at._ms_or_none(float("nan")) is None
    shape = at._json_shape({"M": np.int64(4096), "K": 7, "x": np.float32(0.5), "f": "mxfp4", "o": (1, 2)})
    assert json.loads(json.dumps(shape)) == {"M": 4096, "K": 7, "x": 0.5, "f": "mxfp4", "o": "(1, 2)"}


def test_env_switch_modes(monkeypatch):
    import warnings
    for raw, want in ((None, 1), ("", 1), ("0", 0), (" off ", 0), ("No", 0), ("1", 2), ("yes", 2), ("ON", 2),
                      ("2", 1), ("banana", 1)):
        if raw is None:
            monkeypatch.delenv("VBW_CUPY_AUTOTUNE", raising=False)
        else:
            monkeypatch.setenv("VBW_CUPY_AUTOTUNE", raw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert (at.mode(), at.enabled(), at.forced()) == (want, want > 0, want == 2), raw
        # a value it does not know is said once (as unset), the known ones and unset silently
        assert [str(w.message) for w in caught] == ([] if raw in (None, "", "0", " off ", "No", "1", "yes", "ON") else
                                                    [f"VBW_CUPY_AUTOTUNE={raw!r} is none of 0 / off / false / no, "
                                                     "1 / on / true / yes: read as unset (tune new keys except on "
                                                     "settled archs)"]), raw


def test_settled_arch_uses_the_tuned_cache_but_never_times(env, monkeypatch):
    """On a settled arch with VBW_CUPY_AUTOTUNE unset, a call takes what `vbw-cupy tune` stored and otherwise
    the default, without timing anything; VBW_CUPY_AUTOTUNE=1 tunes there."""
    t = at.get("t_fake")
    at.register(at.Tunable(name="t_fake", params=t.params, candidates=t.candidates, defaults=DEFAULTS,
                           bucket=t.bucket, fits=t.fits, source=t.source, settled=(90,)))
    monkeypatch.delenv("VBW_CUPY_AUTOTUNE")
    loads = []
    load = at._load
    monkeypatch.setattr(at, "_load", lambda path: loads.append(path) or load(path))
    for _ in range(3):  # the file is read once for the shape, not at every plan-cache miss
        assert at.pick("t_fake", {"M": 64, "K": 128}, "float16", noop) == DEFAULTS[90] and not env.calls
    assert len(loads) == 1
    key = at.make_key("t_fake", {"M": 64, "K": 128}, "float16")
    at._store(key, {"config": {"BM": 32, "W": 2}, "ms": 1.0, "default": DEFAULTS[90], "default_ms": 2.0}, "t_fake")
    at.reset()
    assert at.pick("t_fake", {"M": 64, "K": 128}, "float16", noop) == {"BM": 32, "W": 2} and not env.calls
    monkeypatch.setenv("VBW_CUPY_AUTOTUNE", "1")
    at.pick("t_fake", {"M": 1000, "K": 128}, "float16", noop)
    assert env.calls


def test_compiled_kernel_is_kept_in_memory_without_a_disk_cache(monkeypatch):
    """With no usable kernel cache directory, what was compiled is kept in memory: compiled once, not again
    when it is loaded."""
    from vbw_cupy import _runtime as rt
    calls = []
    monkeypatch.setattr(rt, "kernel_cache_dir", lambda: None)
    monkeypatch.setattr(rt, "compile_cubin", lambda f, names, arch, opts: calls.append(names) or
                        (b"\x7fELF-fake", {names[0]: "_Z1kv"}))
    job = ("probe.cu", "k_unstored_test", 90, ())
    try:
        assert rt.compile_jobs([job], progress=False) == {}
        assert rt._cached_cubin(*job, compile=False) == (b"\x7fELF-fake", "_Z1kv")
        assert rt._cached_cubin(*job) == (b"\x7fELF-fake", "_Z1kv") and len(calls) == 1
    finally:
        rt._unstored.pop(job, None)


def test_the_defaults_kernels_compile_first_and_a_stalled_cutoff_is_timed_again(env, monkeypatch):
    """With one compile thread, the default's second kernel is compiled before the other candidates' queued
    kernels (it is timed first; the rest wait for it). A candidate cut off by one slow sample taken while
    compiles still ran (a stall beside them) is timed again once they are done, and can win."""
    import threading
    from vbw_cupy import _runtime as rt
    compiled, asked, lock = set(), [], threading.Lock()
    best, first = {"BM": 64, "W": 4}, threading.Event()
    slow = "main<32, 8>"

    def kernel(name):
        if rt._collect.__dict__.get("on") and name not in compiled:
            raise rt.NeedsCompile(("probe.cu", name, 90, ()))

    def run(c):
        kernel(f"main<{c['BM']}, {c['W']}>")
        if c == DEFAULTS[90]:
            kernel("default_tail")

    def compile_one(job):
        if job[1] == slow:
            first.wait(timeout=10)          # still compiling while `best` is first timed
        elif not job[1].startswith(("default", f"main<{DEFAULTS[90]['BM']}, ")):
            time.sleep(0.02)                # the others take a while: the default's tail is queued meanwhile
        with lock:
            asked.append(job[1])
            compiled.add(job[1])
        return job, None

    def stalled(cfg):
        if cfg == best and not first.is_set():
            first.set()
            return 50.0                     # one sample behind a stall: over the cutoff
        return fake_ms(cfg)
    env.fn = stalled
    monkeypatch.setattr(rt, "_compile_one", compile_one)
    monkeypatch.setattr(at, "_compile_workers", lambda: 2)
    assert at.pick("t_fake", {"M": 64, "K": 128}, "float16", run) == best
    assert asked[0] == f"main<{DEFAULTS[90]['BM']}, {DEFAULTS[90]['W']}>" and asked.index("default_tail") <= 3
    assert [c for c in env.calls if c == best][:2] == [best, best]   # cut off, then timed again
