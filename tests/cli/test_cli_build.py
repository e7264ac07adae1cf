"""`tqexport build`: what it refuses in one line (checkpoints, sizes, scales, calibration
text) and writes nothing for."""

import subprocess
import sys

import pytest
from cli_helpers import one_error_line, run, write_config
from helpers import main_inproc

FAIL_TO_SAVE = """
import errno, sys
import tqexport.export.artifact_build as artifact
from tqexport.cli import main

def full(*_):
    raise OSError(errno.ENOSPC, "No space left on device")

artifact._save = full
main(sys.argv[1:])
"""


def test_no_torch_warning_before_an_error(tmp_path):
    """A build that fails after the export (here: the disk is full) prints its error line
    first: torch's export warnings ("torchvision is not installed") are silenced."""
    out = tmp_path / "art"
    r = subprocess.run([sys.executable, "-c", FAIL_TO_SAVE, "build", "tiny-llama", "-o", str(out),
                        "--kv-cache-dtype", "fp8"], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 2
    assert r.stdout == f"error: cannot write the artifact to {out}: No space left on device\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0"])
def test_build_refuses_non_finite_kv_scales_and_writes_nothing(capsys, tmp_path, value):
    from tqexport.errors import TQExportError
    from tqexport.spec import parse_kv_scales

    with pytest.raises(TQExportError, match="positive finite number"):
        parse_kv_scales(value)
    out = tmp_path / "art"
    code, _, err = main_inproc(capsys, "build", "tiny-llama", "-o", out, "--kv-cache-dtype",
                               "fp8", f"--kv-scales={value}")  # fmt: skip
    assert code == 2
    one_error_line(err, "--kv-scales must be a positive finite number")
    assert list(tmp_path.iterdir()) == []


def test_malicious_pickle_checkpoint_is_one_line_naming_the_file(tmp_path):
    import os

    import torch

    from tqexport.models import builtins

    src = tmp_path / "evil"
    src.mkdir()
    builtins.tiny_config("tiny-llama").save_pretrained(src)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    torch.save({"x": Evil()}, src / "pytorch_model.bin")
    out = tmp_path / "out"
    r = run("build", str(src), "-o", str(out))
    assert r.returncode == 2
    line = one_error_line(r.stderr, str(src / "pytorch_model.bin"))
    assert "refused to unpickle" in line and "posix.system" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil"]  # nothing written, not run


def test_raw_pickle_checkpoint_is_one_line_without_torchs_warning(tmp_path):
    """pickle.dump (not torch.save): torch warns of the pickle protocol before refusing it."""
    import pickle

    from tqexport.models import builtins

    src = tmp_path / "raw"
    src.mkdir()
    builtins.tiny_config("tiny-llama").save_pretrained(src)
    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"x": [1, 2]}, protocol=4))
    r = run("build", str(src), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    line = one_error_line(r.stderr, f"{src / 'pytorch_model.bin'} is not a plain PyTorch")
    assert "refused to unpickle it (Unsupported operand 149)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


def test_a_checkpoint_without_the_models_weights_is_refused_not_filled_at_random(tmp_path):
    """torch.save of weights under other names: transformers would fill the model at random."""
    import torch

    from tqexport.models import builtins

    src = tmp_path / "other"
    src.mkdir()
    builtins.tiny_config("tiny-llama").save_pretrained(src)
    torch.save({"encoder.weight": torch.zeros(2, 2)}, src / "pytorch_model.bin")
    r = run("build", str(src), "-o", str(tmp_path / "out"))
    assert r.returncode == 2
    line = one_error_line(r.stderr, f"{src} holds no weight for lm_head.weight, ")
    assert line.endswith("give the model's own weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_build_refuses_weights_larger_than_this_machine_before_loading(
    capsys, tmp_path, monkeypatch
):
    from tqexport import validate

    monkeypatch.setattr(validate, "physical_memory", lambda: 2**31)
    src = write_config(tmp_path / "big", num_hidden_layers=2, hidden_size=4096,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       intermediate_size=11008, vocab_size=32000)  # fmt: skip
    # q/k/v/o + gated MLP per layer, untied embeddings and head: 4 bytes each as float32
    params = 2 * (2 * 4096 * 128 * (32 + 8) + 3 * 4096 * 11008) + 2 * 32000 * 4096
    assert params == 616_562_688  # 2.3 GiB as float32, 1.15 GiB as float16
    out = tmp_path / "out"
    code, _, err = main_inproc(capsys, "build", src, "-o", out)
    assert code == 2
    assert one_error_line(err, "") == (
        "error: big: its weights take about 2.3 GiB as float32 (616,562,688 parameters by its "
        "config), more than this machine's 2.0 GiB of memory; try --dtype float16"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]
    monkeypatch.setattr(validate, "physical_memory", lambda: 2**30)
    code, _, err = main_inproc(capsys, "build", src, "-o", out, "--dtype", "float16")
    assert code == 2
    line = one_error_line(err, "")
    assert line == (
        "error: big: its weights take about 1.1 GiB as float16 (616,562,688 parameters by its "
        "config), more than this machine's 1.0 GiB of memory; use a smaller model or a larger "
        "machine"
    )


@pytest.mark.parametrize(
    "content,message",
    [
        (bytes(range(128, 256)), "is not UTF-8 text (byte 0x80 at offset 0); give a UTF-8 text "
         "file"),
        (b"", "is empty; give a UTF-8 text file"),
        (b" \n\t\n", "is empty; give a UTF-8 text file"),
    ],
)  # fmt: skip
def test_calibration_text_binary_or_empty_is_one_line(capsys, tmp_path, content, message):
    text = tmp_path / "calib.txt"
    text.write_bytes(content)
    out = tmp_path / "out"
    code, _, err = main_inproc(capsys, "build", "tiny-llama", "-o", out, "--kv-cache-dtype", "fp8",
                               "--kv-scales", "calibrate", "--calibration-text", text)  # fmt: skip
    assert code == 2
    assert one_error_line(err, "") == f"error: --calibration-text {text} {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]


def test_calibration_text_without_a_reader_is_refused(capsys, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("some English text")
    out = tmp_path / "out"
    code, _, err = main_inproc(capsys, "build", "tiny-llama", "-o", out, "--kv-cache-dtype", "fp8",
                               "--calibration-text", text)  # fmt: skip
    assert code == 2
    assert one_error_line(err, "") == (
        "error: --calibration-text is read only by --kv-scales calibrate (and --kv-key-transform "
        "center or smooth); add --kv-scales calibrate or drop --calibration-text"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]
