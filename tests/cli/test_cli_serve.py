"""`tqexport serve`: the API keys it refuses at start."""

import pytest
from helpers import main_inproc

API_KEY_RULE = (
    "which no client can send in an Authorization header; use printable ASCII without spaces"
)


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "is empty; give a key or none"),
        ("s\u00e9cret", f"has a non-ASCII character at position 2, {API_KEY_RULE}"),
        ("my key", f"has a space at position 3, {API_KEY_RULE}"),
        ("key\n", f"has the control character \\n at position 4, {API_KEY_RULE}"),
        ("k\x7f", f"has the control character \\x7f at position 2, {API_KEY_RULE}"),
    ],
)
@pytest.mark.parametrize("how", ["flag", "env", "ray"])
def test_serve_refuses_an_api_key_no_client_can_send(capsys, monkeypatch, tmp_path, key,
                                                     problem, how):  # fmt: skip
    """Refused at start, before the artifact is opened (it does not exist), the key unsaid."""
    monkeypatch.delenv("TQEXPORT_API_KEY", raising=False)
    args = ["serve", str(tmp_path / "none")] + (["--ray"] if how == "ray" else [])
    if how == "env":
        monkeypatch.setenv("TQEXPORT_API_KEY", key)
    else:
        args += ["--api-key", key]
    code, out, err = main_inproc(capsys, *args)
    if key == "":  # the checks every option and the variable have
        problem = ("TQEXPORT_API_KEY is set but empty; give a key or unset it" if how == "env"
                   else "--api-key is empty; give a value or leave it out")  # fmt: skip
    else:
        problem = f"--api-key (or TQEXPORT_API_KEY) {problem}"
    assert (code, out, err) == (2, "", f"error: {problem}\n")


def test_a_printable_api_key_is_accepted_and_the_library_refuses_the_others(tmp_path):
    from tqexport import validate
    from tqexport.errors import TQExportError
    from tqexport.serve.runner import serve

    assert validate.api_key("sk-A1_b2.c3~d4+/=!#$%&'*^`|") == "sk-A1_b2.c3~d4+/=!#$%&'*^`|"
    with pytest.raises(TQExportError, match="^--api-key .* is empty; give a key or none$"):
        serve(tmp_path / "none", api_key="")
    with pytest.raises(TQExportError, match=f"has a space at position 2, {API_KEY_RULE}$"):
        serve(tmp_path / "none", api_key="a b")
