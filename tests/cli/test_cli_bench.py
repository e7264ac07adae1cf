"""`tqexport bench`: its options checked before any build."""

from cli_helpers import one_error_line
from helpers import main_inproc


def test_bench_speed_validates_every_dtype_before_building(capsys, tmp_path):
    work = tmp_path / "bench"
    code, _, err = main_inproc(capsys, "bench", "speed", "tiny-llama", "--kv-cache-dtype",
                               "fp8,fp9", "--workdir", work)  # fmt: skip
    assert code == 2
    one_error_line(err, "unknown kv-cache dtype 'fp9'")
    assert not work.exists()  # not even the auto artifact was built
