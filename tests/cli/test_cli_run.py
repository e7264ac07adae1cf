"""`tqexport run` (and `parity` where they share a path): prompts, tokenizers, chat templates,
and damaged sources or graphs refused in one line."""

import dataclasses
import json

import pytest
from cli_helpers import one_error_line, run, truncated_gguf_error
from helpers import main_inproc

# --- `run` with a tokenizer: tiny artifacts have none, so a byte-level one is written in ---


def write_tokenizer(d, chat_template=None):
    """A byte-level BPE tokenizer of exactly 256 tokens (tiny-llama's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": alphabet[1],
           "eos_token": alphabet[2]}  # fmt: skip
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def served(artifacts, tmp_path):
    """A copy of the tiny-llama fp8 artifact with a tokenizer (and chat template) written in."""
    import shutil

    def make(chat_template=None, name="art"):
        d = tmp_path / name
        shutil.copytree(artifacts("tiny-llama", "fp8"), d)
        return write_tokenizer(d, chat_template)

    return make


def test_run_prints_prompts_with_markup_and_escapes_literally(served, tmp_path, capsys):
    art = served()
    f = tmp_path / "prompts.txt"
    f.write_text("hello [/x] \x1b[31mred\n[bold]two[/bold] :100:\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f, "--max-tokens", "3")
    assert code == 0, err
    assert "hello [/x] \\x1b[31mred" in out and "[bold]two[/bold] :100:" in out
    assert "\x1b" not in out and "\N{HUNDRED POINTS SYMBOL}" not in out
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f, "--max-tokens", "3",
                                 "--json")  # fmt: skip
    assert code == 0
    results = json.loads(out)["results"]
    assert [r["prompt"] for r in results] == ["hello [/x] \x1b[31mred", "[bold]two[/bold] :100:"]
    assert all(len(r["token_ids"]) == 3 for r in results)


def test_run_refuses_a_binary_prompts_file(served, tmp_path, capsys):
    f = tmp_path / "prompts.bin"
    f.write_bytes(b"ok\n\xff\xfe\x00binary")
    code, out, err = main_inproc(capsys, "run", served(), "--prompts-file", f)
    assert code == 2 and out == ""
    one_error_line(err, f"--prompts-file {f} is not UTF-8 text (byte 0xff at offset 3)")


def test_run_position_limit_rejects_up_front_and_all_rejected_exits_1(served, tmp_path, capsys):
    art = served()  # tiny-llama: max_position_embeddings 512, one token per byte
    f = tmp_path / "p.txt"
    f.write_text("x" * 600 + "\nshort\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f, "--max-tokens", "2",
                                 "--json")  # fmt: skip
    assert code == 0, err  # the other prompt completes
    res = json.loads(out)["results"]
    assert res[0]["finish_reason"].startswith("rejected: a prompt of 600 tokens exceeds the mod")
    assert res[0]["token_ids"] == [] and len(res[1]["token_ids"]) == 2
    assert "warning: request 0: rejected" in err and "position limit of 512" in err
    f.write_text("x" * 600 + "\n" + "y" * 512 + "\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompts-file", f)
    assert code == 1  # every prompt rejected
    assert err.count("warning: request") == 2 and "Traceback" not in err
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "z" * 500, "--json")
    assert code == 0
    assert len(json.loads(out)["results"][0]["token_ids"]) == 12  # capped at 512 positions
    assert "at most 12 tokens generated" in err


def test_run_a_request_that_fails_while_running_ends_alone_and_exits_1(
    served, tmp_path, capsys, monkeypatch
):
    from tqexport.runtime import executor

    real = executor.sample

    def faulty(logits, params, rng):
        if params.seed == 1:  # request 1 samples with --seed + 1
            raise RuntimeError("injected sampling fault\nsecond line")
        return real(logits, params, rng)

    art, f = served(), tmp_path / "p.txt"
    f.write_text("one\ntwo\nthree\n")
    args = ("run", art, "--prompts-file", f, "--max-tokens", "3", "--json")
    code, out, err = main_inproc(capsys, *args)
    assert code == 0, err
    want = [r["token_ids"] for r in json.loads(out)["results"]]
    monkeypatch.setattr(executor, "sample", faulty)
    code, out, err = main_inproc(capsys, *args)
    assert code == 1 and "Traceback" not in err
    res = json.loads(out)["results"]
    assert [r["finish_reason"] for r in res] == ["length", "error: injected sampling fault",
                                                 "length"]  # fmt: skip
    assert [r["token_ids"] for r in res] == [want[0], [], want[2]]
    assert "warning: request 1: error: injected sampling fault\n" in err


def test_run_every_prompt_rejected_by_the_cache_exits_1(served, capsys):
    code, _, err = main_inproc(capsys, "run", served(), "--prompt", "x" * 100, "--num-blocks",
                               "3")  # fmt: skip
    assert code == 1
    assert "warning: request 0: rejected: a prompt of 100 tokens does not fit" in err


def test_run_json_never_reads_a_chat_template_linked_outside(served, tmp_path, capsys):
    """A chat_template.jinja linked to a file elsewhere used to become the prompt: its bytes
    came back as prompt_token_ids."""
    art = served()
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    (art / "chat_template.jinja").symlink_to(secret)
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi", "--max-tokens", "2",
                                 "--json")  # fmt: skip
    assert code == 2 and out == ""
    one_error_line(err, f"{art / 'chat_template.jinja'} is a link to {str(secret)!r}, outside")


def test_run_num_blocks_beyond_this_machines_memory(served, capsys, monkeypatch):
    from tqexport import validate

    monkeypatch.setattr(validate, "physical_memory", lambda: 2**30)
    code, _, err = main_inproc(capsys, "run", served(), "--prompt", "hi", "--num-blocks",
                               "1000000000")  # fmt: skip
    assert code == 2
    one_error_line(err, "--num-blocks 1000000000 needs 22.4 TiB of KV cache, more than this mach")


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("tokenizer.json", "garbage{", "tokenizer.json is not valid JSON"),
        ("tokenizer.json", '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {}}}',
         "cannot load the tokenizer"),
        ("tokenizer_config.json", b"\xff\xfe", "tokenizer_config.json is not UTF-8 text"),
        ("tokenizer_config.json", "[1, 2]", "tokenizer_config.json must hold a JSON object"),
        ("generation_config.json", "{", "generation_config.json is not valid JSON"),
        ("generation_config.json", '{"eos_token_id": "two"}', "eos_token_id must be a token id"),
    ],
)  # fmt: skip
def test_run_garbage_tokenizer_files_are_one_line_naming_the_file(
    served, capsys, name, content, message
):
    art = served()
    path = art / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2 and out == ""
    assert str(art) in one_error_line(err, message)


def test_run_tokenizer_that_encodes_to_nothing_names_its_file(served, capsys):
    art = served()
    data = json.loads((art / "tokenizer.json").read_text())
    data["model"]["vocab"] = {"a": 0}  # every byte of "hi" is unknown and dropped
    (art / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2
    one_error_line(err, f"{art / 'tokenizer.json'} encodes the prompt 'hi' to no tokens")


def test_run_tokenizer_of_another_model_is_refused(served, capsys):
    art = served()
    data = json.loads((art / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["h"] = 300  # beyond tiny-llama's 256 ids
    (art / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2
    one_error_line(err, "gives token id 300 for prompt 0, outside the model's vocabulary of 256")


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\\n"
    "{% endif %}"
)


@pytest.mark.parametrize(
    "template",
    [
        CHATML,
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m.content|tojson }}{% endfor %}{{ ns.n }}{{ bos_token }}{{ eos_token }}",
        "{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}{% generation %}"
        "{{ m['content'] | trim }}{% endgeneration %}{% endfor %}",
        "{{ messages[0].content * 3 }}{{ '%s-%d' % ('a', 3) }}{{ '{}x'.format(4) }}"
        "{{ 'abc'|replace('b', 'zz') }}{{ dict(a=1)|tojson }}{{ range(3)|list }}",
    ],
)
def test_limited_template_renders_exactly_like_transformers(tmp_path, template):
    from transformers import AutoTokenizer

    from tqexport.runtime.text import encode_prompt

    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path, template))
    messages = [{"role": "user", "content": "héllo [/x]"}]
    ref = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert encode_prompt(tok, "héllo [/x]", True, tmp_path) == ref


@pytest.mark.parametrize(
    "template,message",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         "took longer than 5 s"),
        ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "renders more than 1048"),
        ("{{ 'x' * 1000000000 }}", "builds a value of 1000000000 items"),
        ("{{ 'x'|center(1000000000) }}", "passes 1000000000 to a function"),
        ("{{ '{:>999999999}'.format(1) }}", "formats with a width of a million"),
        ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
         "{% endfor %}{{ ns.s }}", "builds a value of 2097152 items"),
        ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "fails: maximum recursion depth"),
        ("{{ ''.__class__.__mro__ }}", "fails: access to attribute '__class__'"),
        ("{{ raise_exception('no [/x] \x1b[2J here') }}", "fails: no [/x] \\x1b[2J here"),
        ("{% if false %}x{% endif %}", "renders nothing for the prompt 'hi'"),
    ],
)  # fmt: skip
def test_hostile_chat_templates_stop_with_one_line(served, capsys, template, message):
    import time

    art = served(template)
    t0 = time.monotonic()
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert time.monotonic() - t0 < 30
    assert code == 2 and out == ""
    assert f"the chat template in {art / 'tokenizer_config.json'}" in one_error_line(err, message)
    assert "--no-chat-template" in err


def test_hostile_chat_template_cannot_hang_the_cli(served):
    art = served("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    r = run("run", str(art), "--prompt", "hi")  # timeout=120 in run()
    assert r.returncode == 2
    one_error_line(r.stderr, "took longer than 5 s; it is stopped there")
    r = run("run", str(art), "--prompt", "hi", "--no-chat-template", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr


# --- damaged sources and graphs, unknown graph domains ---


def test_torch_backend_source_gguf_truncated_is_one_line(served, capsys, tmp_path, gguf_bytes):
    import onnx

    from tqexport.contract.files import MODEL_FILE, SPEC_FILE, set_spec_metadata
    from tqexport.spec import spec_from_json

    gguf_path = tmp_path / "source.gguf"
    gguf_path.write_bytes(gguf_bytes[:100])
    art = served()
    spec = spec_from_json((art / SPEC_FILE).read_text())
    spec = dataclasses.replace(spec, model={**spec.model, "path": str(gguf_path)})
    graph = onnx.load(str(art / MODEL_FILE), load_external_data=False)
    set_spec_metadata(graph, spec)
    onnx.save(graph, str(art / MODEL_FILE))
    (art / SPEC_FILE).write_text(spec.to_json() + "\n")
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi", "--backend", "torch")
    assert code == 2 and out == ""
    truncated_gguf_error(err, gguf_path)


def _graph_edit(art, edit):
    import onnx

    graph = onnx.load(str(art / "model.onnx"), load_external_data=False)
    node = next(n for n in graph.graph.node if n.op_type == "Concat")
    edit(graph, node)
    onnx.save(graph, str(art / "model.onnx"))
    return node.name


def _foreign_domain(graph, node):
    node.domain = "evil.ops"


def _foreign_domain_imported(graph, node):
    import onnx

    node.domain = "evil.ops"
    graph.opset_import.append(onnx.helper.make_opsetid("evil.ops", 1))


@pytest.mark.parametrize("edit", [_foreign_domain, _foreign_domain_imported])
@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["parity", "--steps", "1"]])
def test_node_in_an_unknown_domain_is_one_line_naming_it(served, capsys, edit, command):
    art = served()
    name = _graph_edit(art, edit)
    code, out, err = main_inproc(capsys, command[0], art, *command[1:])
    assert code == 2 and out == ""
    assert one_error_line(err, "") == (
        f"error: {art / 'model.onnx'}: node {name!r} (Concat) is in domain 'evil.ops', which "
        "neither ONNX Runtime nor the model's functions define; rebuild the artifact"
    )


def test_graph_onnx_runtime_cannot_load_is_one_line(served, capsys):
    def bad_axis(graph, node):
        next(a for a in node.attribute if a.name == "axis").i = 99

    art = served()
    name = _graph_edit(art, bad_axis)
    code, out, err = main_inproc(capsys, "run", art, "--prompt", "hi")
    assert code == 2 and out == ""
    assert one_error_line(err, "") == (
        f"error: ONNX Runtime cannot load {art / 'model.onnx'}: Node ({name}) Op (Concat) "
        "[ShapeInferenceError] axis must be in [-rank, rank-1].; rebuild the artifact"
    )


@pytest.mark.parametrize("command", [["run", "--prompt", "hi"], ["parity", "--steps", "1"]])
def test_attribute_the_native_kernels_refuse_at_start_up_is_one_line(served, capsys, command):
    """A graph tampered after its build (window=-1): the native kernel's start-up refusal names
    the layer and the attribute, in one line (serve and bench open sessions as run does)."""
    import onnx

    from tqexport.contract.artifact import open_artifact
    from tqexport.native.kernel_choice import choose

    art = served()
    graph = onnx.load(str(art / "model.onnx"), load_external_data=False)
    node = next(n for n in graph.graph.node if n.op_type == "PagedAttention")
    next(a for a in node.attribute if a.name == "window").i = -1
    layer = next(a.i for a in node.attribute if a.name == "layer")
    onnx.save(graph, str(art / "model.onnx"))
    if choose(open_artifact(art).spec, "auto").library is None:
        pytest.skip("the native kernel library cannot be built here (no ONNX Runtime headers)")
    code, out, err = main_inproc(capsys, command[0], art, *command[1:], "--kernels", "native")
    assert code == 2 and out == ""
    assert one_error_line(err, "") == (
        f"error: ONNX Runtime refused {art / 'model.onnx'} at start-up: layer {layer}'s "
        "PagedAttention node: window, recent_window and sink_tokens must be >= 0 (it has "
        "window=-1); the graph was changed after its build, rebuild the artifact"
    )
