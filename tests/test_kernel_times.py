"""tools/kernel_times.py: its arguments and --compare on CPU, its timing on a GPU."""
import importlib.util
import json
import os

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("kernel_times", os.path.join(ROOT, "tools", "kernel_times.py"))
kernel_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_times)


def test_shapes_parse_with_their_layout():
    assert kernel_times.parse_shape("8,64,32,32") == ((8, 64, 32, 32), False)
    assert kernel_times.parse_shape("8,64,32,32:cl") == ((8, 64, 32, 32), True)
    assert kernel_times.parse_shape("2,3,5,6,7") == ((2, 3, 5, 6, 7), False)
    for text, message in [("8,64", "3 to 5"), ("8,64,x,2", "3 to 5"), ("8,0,4,4", "at least 1"),
                          ("8,64,4,4:nhwc", "':cl'"), ("2,3,5,6,7:cl", "4-d")]:
        with pytest.raises(ValueError, match=message):
            kernel_times.parse_shape(text)


def test_every_default_shape_parses():
    assert len({kernel_times.parse_shape(text) for text in kernel_times.DEFAULT_SHAPES}) == len(
        kernel_times.DEFAULT_SHAPES)


def test_compare_prints_the_mean_of_each_side(tmp_path):
    key = kernel_times.case_key((1, 64, 16, 16), True, "bfloat16", "same")
    files = {}
    for name, flushed, hot in [("a1", 4.0, 3.0), ("a2", 6.0, 5.0), ("b1", 4.5, 2.0)]:
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({key: {"flushed": flushed, "hot": hot, "kernels": ["k"]},
                                           "only|here": {"flushed": 1.0, "hot": 1.0, "kernels": []}}))
    lines = kernel_times.compare([str(files["a1"]), str(files["a2"])], [str(files["b1"])])
    assert lines[0].startswith("kernel us, mean of 2 against 1 files")
    row = next(line for line in lines if line.startswith(key))
    assert "5.00 ->     4.50 (-10.0%)" in row and "4.00 ->     2.00 (-50.0%)" in row


@pytest.mark.parametrize("argv, message", [([], "OUT.json is required"),
                                           (["o.json", "--dtypes", "float32,int8"], "--dtypes"),
                                           (["o.json", "--shape", "1,2"], "--shape '1,2'"),
                                           (["o.json", "--calls", "0"], "--calls"),
                                           (["--compare", "missing.json", "also.json"], "no such file")])
def test_bad_arguments_exit_2_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        kernel_times.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.gpu
def test_times_every_case_of_a_shape(tmp_path):
    out = tmp_path / "times.json"
    assert kernel_times.main([str(out), "--shape", "2,16,8,8:cl", "--shape", "3,5,7,7", "--calls", "3"]) == 0
    results = json.loads(out.read_text())
    assert len(results) == 2 * (3 + 2)  # per shape: bfloat16 none, fp32, same; float32 none, fp32
    for key, times in results.items():
        assert times["flushed"] > 0 and times["hot"] > 0 and times["kernels"], key
