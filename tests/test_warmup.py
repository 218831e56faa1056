"""Cold start on the CPU, compiling mocked: what `vbw-cupy warmup` compiles for an architecture, ops or a model;
the progress bar and the notice a slow compile or tuning step prints."""
import json
import time

import pytest

from vbw_cupy import _progress, _warmup, attention, cli, fp4, gemm, paged
from vbw_cupy import _runtime as rt


@pytest.fixture
def compiled(monkeypatch):
    """cli's precompile replaced: records (instances, arch) and compiles nothing."""
    calls = []
    monkeypatch.setattr(rt, "have_cupy", lambda: True)
    monkeypatch.setattr(rt, "precompile", lambda insts, arch, workers=None, progress=True: calls.append(
        (set(insts), arch)) or [])
    return calls


@pytest.mark.parametrize("arch", [80, 86, 90])
def test_instances_hold_what_the_ops_launch_by_default_and_no_hopper_kernel_elsewhere(arch):
    insts = set(_warmup.op_instances(["flash_attention"], arch))
    for hd in attention.HEAD_DIMS:
        for dt in ("float16", "bfloat16"):
            cfg = attention.default_config(hd, arch)
            assert (attention.SOURCE, attention.instance_name(dt, hd, cfg, True, tma=cfg["KIND"] != "mma")) in insts
    wg = {n for _, n in attention.kernel_instances()} - {n for _, n in attention.kernel_instances(arch=80)}
    assert wg and (not wg & {n for _, n in insts}) == (arch != 90)
    every = set(_warmup.op_instances(None, arch))
    assert insts < every and every <= {i for m in cli.op_modules() for i in m.kernel_instances()}
    no_gemm_wg = {n for _, n in gemm.kernel_instances()} - {n for _, n in gemm.kernel_instances(arch=86)}
    assert no_gemm_wg and bool(no_gemm_wg & {n for _, n in every}) == (arch == 90)


def test_quantize_e4m3_warms_its_amax_pass_too():
    """quantize_e4m3 launches fp4_codec.cu's abs_max (shared with NVFP4's default scale): warmup compiles it."""
    insts = set(_warmup.op_instances(["quantize_e4m3"], 90))
    assert {("fp4_codec.cu", f"abs_max<{t}>") for t in ("__half", "__nv_bfloat16", "float")} <= insts


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="ops: unknown matmul"):
        _warmup.op_instances(["matmul"], 80)


def test_cli_warmup_ops(compiled, capsys):
    assert cli.main(["warmup", "--arch", "80", "--ops", "quantize", "dequantize"]) == 0
    assert compiled == [(set(fp4.kernel_instances()), 80)]
    assert "sm_80" in capsys.readouterr().out


def test_cli_warmup_model_compiles_its_head_dim_only(compiled, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024, num_hidden_layers=2,
        vocab_size=1000)))
    assert cli.main(["warmup", "--arch", "90", "--model", str(tmp_path)]) == 0
    (insts, arch), = compiled
    assert arch == 90
    assert set(attention.kernel_instances(arch=90, head_dims=[64])) <= insts
    assert not set(attention.kernel_instances(arch=90, head_dims=[128])) & insts
    assert set(paged.kernel_instances(head_dims=[64])) <= insts and set(gemm.kernel_instances(arch=90)) <= insts
    assert not {n for f, n in insts if f == "sparse_attention.cu"}


def test_cli_warmup_that_cannot_store_fails(compiled, monkeypatch, tmp_path, capsys):
    # a cache directory that is a file: the kernels compiled into this process's memory only, exit 0 said
    # they were kept
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(blocker))
    monkeypatch.setattr(rt, "_warned", set())
    with pytest.warns(RuntimeWarning, match="cannot use"):
        assert cli.main(["warmup", "--arch", "80", "--ops", "quantize"]) == 1
    assert "could not be written: nothing was kept" in capsys.readouterr().err


def test_cli_warmup_without_a_gpu_asks_for_arch(compiled, monkeypatch, capsys):
    monkeypatch.setattr(rt, "gpu_available", lambda: False)
    assert cli.main(["warmup"]) == 1 and not compiled
    assert "--arch" in capsys.readouterr().err
    assert cli.main(["warmup", "--arch", "90", "--model", "/no/such/checkpoint"]) == 2


def test_notice_only_for_slow_steps(capsys):
    with _progress.notice("quick", after=0.5):
        pass
    assert capsys.readouterr().err == ""
    with _progress.notice("compiling x", after=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert "vbw_cupy: compiling x ..." in err and "compiling x: done in" in err


@pytest.mark.parametrize("have_tqdm", [True, False])
def test_bar_appears_after_the_delay(have_tqdm, monkeypatch, capsys):
    if not have_tqdm:
        monkeypatch.setattr(_progress, "_tqdm", None)
    elif _progress._tqdm is None:
        pytest.skip("tqdm is not installed")

    def slow():
        for i in range(4):
            time.sleep(0.1)
            yield i
    assert list(_progress.bar(slow(), 4, "compiling for sm_90", after=0.15)) == [0, 1, 2, 3]
    err = capsys.readouterr().err
    assert "compiling for sm_90" in err and "4/4" in err
    assert list(_progress.bar(range(3), 3, "quick", after=5)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_first_compile_past_the_delay_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("VBW_CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_progress, "AFTER_S", 0.05)
    monkeypatch.setattr(rt, "nvrtc_version", lambda: "12.8")
    monkeypatch.setattr(rt, "compile_cubin", lambda f, names, arch, extra=(): time.sleep(0.3) or (
        b"\x7fELF fake", {names[0]: "_Z4fakev"}))
    assert rt._cached_cubin("fp4_codec.cu", "abs_max<float>", 90, ()) == (b"\x7fELF fake", "_Z4fakev")
    err = capsys.readouterr().err
    assert "compiling abs_max<float> (fp4_codec.cu, sm_90" in err and "done in" in err
    assert rt._cached_cubin("fp4_codec.cu", "abs_max<float>", 90, ()) == (b"\x7fELF fake", "_Z4fakev")
    assert capsys.readouterr().err == ""  # from the disk cache: nothing to say
