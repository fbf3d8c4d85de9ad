"""Hardware profiles: validation, device selection, cost-model helpers and the probe (tiny sizes)."""

from __future__ import annotations

import types

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from kvbench import hardware_probe
from kvbench.errors import KVBenchError
from kvbench.hardware import (
    HardwareProfile,
    available_profiles,
    check_available,
    conf_dir,
    load_profile,
    modelled_recompute_seconds,
    modelled_transfer_seconds,
)
from kvbench.hardware_probe import probe

BASE = {"name": "t", "device": "cpu", "dtype": "bfloat16", "memory_bytes": 1 << 30}


def _profile(**overrides) -> HardwareProfile:
    return HardwareProfile.from_config({**BASE, **overrides})


def test_conf_dir_is_the_checkout_conf():
    assert (conf_dir() / "hardware" / "cpu.yaml").is_file()


def test_shipped_profiles_load_and_follow_the_schema():
    names = available_profiles()
    assert {"cpu", "consumer-gpu-24g", "server-gpu-80g"} <= set(names)
    schema = set(yaml.safe_load((conf_dir() / "hardware" / "cpu.yaml").read_text()))
    for name in names:
        raw = yaml.safe_load((conf_dir() / "hardware" / f"{name}.yaml").read_text())
        assert set(raw) == schema, name
        p = load_profile(name)
        assert p.name == name and p.dtype == "bfloat16" and p.sources
        # Hydra reads the same files through OmegaConf; both parsers must agree on every value.
        assert HardwareProfile.from_config(OmegaConf.load(conf_dir() / "hardware" / f"{name}.yaml")) == p


def test_gpu_profiles_carry_datasheet_figures():
    consumer, server = load_profile("consumer-gpu-24g"), load_profile("server-gpu-80g")
    for p in (consumer, server):
        assert p.device == "cuda"
        assert None not in (p.device_mem_bw_gbps, p.host_link_bw_gbps, p.disk_bw_gbps, p.peak_flops)
    assert consumer.memory_bytes == 24 * 2**30 and server.memory_bytes == 80 * 2**30
    # PCIe 4.0 x16 and 5.0 x16, one direction: lanes × GT/s × 128/130 / 8.
    assert consumer.host_link_bw_gbps == pytest.approx(16 * 16 * 128 / 130 / 8, abs=0.05)
    assert server.host_link_bw_gbps == pytest.approx(16 * 32 * 128 / 130 / 8, abs=0.05)
    assert server.device_mem_bw_gbps > consumer.device_mem_bw_gbps
    assert server.peak_flops > consumer.peak_flops


def test_cpu_profile_was_filled_by_the_probe():
    p = load_profile("cpu")
    assert p.device == "cpu" and p.host_link_bw_gbps is None
    assert p.device_mem_bw_gbps and p.disk_bw_gbps and p.peak_flops
    assert any("measured by kvbench hardware probe" in s for s in p.sources)


def test_from_config_accepts_dictconfig():
    p = HardwareProfile.from_config(OmegaConf.create({**BASE, "simulate": True, "peak_flops": 1.5e12}))
    assert p.simulate is True and p.peak_flops == 1.5e12


@pytest.mark.parametrize(("override", "fragment"), [
    ({"device": "tpu"}, "valid: cpu, cuda"),
    ({"dtype": "int8"}, "valid: float32, bfloat16, float16"),
    ({"memory_bytes": -1}, "memory_bytes must be a positive integer"),
    ({"memory_bytes": True}, "memory_bytes must be a positive integer"),
    ({"memory_bytes": 1.5}, "memory_bytes must be a positive integer"),
    ({"threads": 0}, "threads must be null"),
    ({"simulate": "yes"}, "simulate must be true or false"),
    ({"disk_bw_gbps": -2.0}, "disk_bw_gbps must be null or a positive number"),
    ({"peak_flops": "1e12"}, "peak_flops must be null or a positive number"),
    ({"sources": "datasheet"}, "sources must be a list of strings"),
    ({"bandwidth": 3}, "unknown key(s) bandwidth; valid keys: name, device"),
    ({"name": None}, "missing required key(s) name"),
])
def test_validation_errors_are_one_line_and_name_the_fix(override, fragment):
    with pytest.raises(KVBenchError) as err:
        _profile(**override)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_non_mapping_is_rejected():
    with pytest.raises(KVBenchError, match="mapping"):
        HardwareProfile.from_config(["cpu"])


def test_unknown_profile_names_the_valid_choices():
    with pytest.raises(KVBenchError, match=r"unknown hardware 'h100'; valid: .*consumer-gpu-24g.*cpu"):
        load_profile("h100")


def test_check_available_cpu_and_cuda(monkeypatch):
    assert check_available(_profile()) == "cpu"
    gpu = load_profile("consumer-gpu-24g")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KVBenchError) as err:
        check_available(gpu)
    assert str(err.value) == (
        "hardware=consumer-gpu-24g needs a CUDA device; none is visible. Run on a CUDA machine or pass "
        "hardware.simulate=true to run here with modelled figures labelled as such")
    simulated = HardwareProfile.from_config({**gpu.to_dict(), "simulate": True})
    assert check_available(simulated) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_available(gpu) == "cuda"
    assert check_available(simulated) == "cuda"  # simulate only matters when no CUDA is visible


def test_modelled_transfer_and_recompute():
    gpu = load_profile("consumer-gpu-24g")
    gib = 2**30
    assert modelled_transfer_seconds(gpu, gib, "host") == pytest.approx(gib / 31.5e9)
    assert modelled_transfer_seconds(gpu, gib, "device") == pytest.approx(gib / 1008e9)
    assert modelled_transfer_seconds(gpu, gib, "disk") == pytest.approx(gib / 7.45e9)
    assert modelled_transfer_seconds(gpu, 0, "disk") == 0.0
    assert modelled_recompute_seconds(gpu, 1.652e14) == pytest.approx(1.0)
    with pytest.raises(KVBenchError, match="valid: device, host, disk"):
        modelled_transfer_seconds(gpu, gib, "nvlink")
    with pytest.raises(KVBenchError, match="non-negative"):
        modelled_transfer_seconds(gpu, -1, "host")
    with pytest.raises(KVBenchError, match="non-negative"):
        modelled_recompute_seconds(gpu, -1)


def test_cpu_host_tier_is_an_in_memory_copy_and_missing_figures_say_so():
    cpu = _profile(device_mem_bw_gbps=20.0)
    # No host link on a CPU host: moving N bytes to the "host" tier is a copy, 2N bytes of traffic.
    assert modelled_transfer_seconds(cpu, 1e9, "host") == pytest.approx(2 * 1e9 / 20e9)
    with pytest.raises(KVBenchError, match="hardware=t has no disk_bw_gbps figure.*kvbench hardware probe"):
        modelled_transfer_seconds(cpu, 1e9, "disk")
    with pytest.raises(KVBenchError, match="no peak_flops figure"):
        modelled_recompute_seconds(cpu, 1e9)


@pytest.mark.parametrize("value", [1.652e14, 2e11, 12.34, 0.5, 1e-5, 3.0])
def test_yaml_floats_read_back_as_floats_by_pyyaml_and_omegaconf(value):
    text = f"x: {hardware_probe._scalar(value)}"
    assert yaml.safe_load(text)["x"] == value
    assert OmegaConf.create(text).x == value


def test_probe_writes_a_valid_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "tiny-host.yaml"
    result = probe(out, copy_bytes=1 << 20, disk_bytes=1 << 20, matmul_n=64, repeats=1, disk_dir=tmp_path)
    assert result["path"] == str(out)
    p = load_profile(out)
    assert p == HardwareProfile.from_config(result["profile"])
    assert p.name == "tiny-host" and p.device == "cpu" and p.dtype in ("bfloat16", "float32")
    assert p.host_link_bw_gbps is None
    assert p.device_mem_bw_gbps > 0 and p.disk_bw_gbps > 0 and p.peak_flops > 0 and p.memory_bytes > 0
    assert p.sources[0].startswith("measured by kvbench hardware probe on ")
    m = result["measurements"]
    assert m["bfloat16_flops"] > 0 and m["float32_flops"] > 0 and m["disk_write_gbps"] > 0
    assert p.peak_flops == pytest.approx(m[f"{p.dtype}_flops"], rel=1e-3)
    assert list(tmp_path.iterdir()) == [out]  # the disk test's temporary file is gone
    assert set(yaml.safe_load(out.read_text())) == set(yaml.safe_load((conf_dir() / "hardware" / "cpu.yaml")
                                                                      .read_text()))


def test_probe_honours_dtype_and_name(tmp_path):
    result = probe(tmp_path / "a.yaml", name="lab-box", dtype="float32", copy_bytes=1 << 16,
                   disk_bytes=1 << 16, matmul_n=16, repeats=1, disk_dir=tmp_path)
    assert result["profile"]["name"] == "lab-box" and result["profile"]["dtype"] == "float32"
    with pytest.raises(KVBenchError, match="valid: auto, bfloat16, float32"):
        probe(tmp_path / "b.yaml", dtype="int8")


def test_cli_exit_codes(tmp_path, capsys):
    out = tmp_path / "cli.yaml"
    assert hardware_probe.main(["probe", "--out", str(out), "--copy-mib", "1", "--disk-mib", "1",
                          "--matmul-n", "32", "--repeats", "1", "--disk-dir", str(tmp_path)]) == 0
    assert "measured by kvbench hardware probe" in capsys.readouterr().out
    assert load_profile(out).name == "cli"
    assert hardware_probe.main(["list"]) == 0
    assert "consumer-gpu-24g" in capsys.readouterr().out
    assert hardware_probe.main([]) == 2
    assert hardware_probe.main(["probe", "--copy-mib", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert hardware_probe.main(["--help"]) == 0


def test_timed_figures_warm_up_first_and_a_bound_takes_the_fastest(monkeypatch):
    """A figure is timed only after a quarter of a second of untimed calls (cold calls run slow: one warm-up call
    left a decode product's rate 0.62x its settled value), then the median of the timed calls, or for a bound (the
    throughput roofline's rates) the fastest."""
    clock = [0.0]
    monkeypatch.setattr(hardware_probe, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fn_with(durations):
        it = iter(durations)
        return lambda: clock.__setitem__(0, clock[0] + next(it))

    cold = [0.1, 0.1, 0.1]  # 0.3 s of warm-up: past WARMUP_S on the third call
    assert hardware_probe.WARMUP_S == 0.25
    assert hardware_probe._timed_seconds(fn_with([*cold, 0.003, 0.001, 0.002]), 3) == pytest.approx(0.002)
    assert hardware_probe._timed_seconds(fn_with([*cold, 0.003, 0.001, 0.002]), 3, best=True) == pytest.approx(0.001)
    # a single cold call never counts, however fast the machine is afterwards
    assert hardware_probe._timed_seconds(fn_with([0.5, 0.004, 0.004]), 2) == pytest.approx(0.004)
