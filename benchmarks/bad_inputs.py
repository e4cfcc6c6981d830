"""The bad-input round of the adversarial campaign: every spelling of an input as `--out`,
every single edit of a manifest, config values of the wrong type, model directories and GGUF
files of every defect, non-UTF-8 `--out` paths, texts that are no text.

Each case is one run of a job forked by the campaign's server (`fault_campaign.ForkServer`)
with a limit of 3x the job's normal run time; it must end with exit 2 and one `error:` line
(no traceback, no output written), or, where the input is a valid one after all (a config
value of the right type, an edit that does not change the model), with exit 0 and the
result of the unchanged input. Counted: cases, hangs (killed at the limit), tracebacks,
wrong-data exits (exit 0 with another result, or where a refusal was due) and other failures.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.fault_campaign import ROOT, ForkServer, Job, _private, snapshot

TIME_FACTOR = 3  # a case may take this many times its job's normal run


@dataclass
class Counts:
    cases: int = 0
    refused: int = 0  # exit 2, one line: the bad inputs
    accepted: int = 0  # exit 0 with the unchanged input's result (a valid value after all)
    accepted_cases: list = field(default_factory=list)
    hangs: int = 0
    tracebacks: int = 0
    wrong_data_exits: int = 0
    failed: int = 0
    notes: list = field(default_factory=list)
    slowest: float = 0.0  # the largest (case time / its job's normal time)


def eval_job(converted: Path, text: Path) -> Job:
    """`eval` as a job of the campaign (its `--out` is the JSON result)."""
    return Job("eval", "cmoe_jax.eval.cli", ["--model", str(converted), "--data-path", str(text),
                                             "--seqlen", "16", "--max-windows", "2", "--no-progress"])


class BadInputs:
    """The round for `jobs` ({name: Job}, their fault points learnt), on private copies."""

    def __init__(self, server: ForkServer, jobs: dict[str, Job], converted: Path, dense: Path, text: Path,
                 work: Path):
        self.server, self.counts = server, Counts()
        self.base = work / "bad-inputs"
        shutil.rmtree(self.base, ignore_errors=True)
        self.base.mkdir(parents=True)
        self.jobs = {**jobs, "eval": eval_job(converted, text)}
        self.converted, self.dense, self.text = converted, dense, text
        self.normal: dict[str, float] = {}
        self.n = 0

    # -- running and judging ----------------------------------------------------------------------
    def time_normal(self, runs: int = 2) -> None:
        """Each job's normal run time: the slowest of `runs` plain runs writing a fresh output
        (on a shared machine one run's time varies by more than a factor of 2)."""
        for name, job in self.jobs.items():
            out = self.base / f"normal-{name}"
            for _ in range(runs):
                t0 = time.perf_counter()
                code, text = self._run(job.module, job.command(out, resume=False), f"normal-{name}")
                self.normal[name] = max(self.normal.get(name, 0.0), time.perf_counter() - t0)
                if code != 0:
                    raise RuntimeError(f"{name} does not run: {text[-1000:]}")
                _remove(out)

    def _run(self, module: str, argv: list, case: str, limit: float | None = None) -> tuple[object, str]:
        self.n += 1
        log = self.base / f"{self.n:04d}.log"
        code, = self.server.run([{"module": module, "argv": argv, "log": str(log), "limit": limit}])
        text = log.read_text(errors="replace")
        log.unlink()
        return code, text

    def case(self, job_name: str, argv: list, case: str, out: Path | None = None, same=None,
             needle: str = "") -> None:
        """Run one case of `job_name` with `argv`; `same()` (when given) says whether an exit 0
        gave the unchanged input's result; `out`: a path that a refusal must not create."""
        job = self.jobs[job_name]
        limit = TIME_FACTOR * self.normal[job_name]
        existed = out is not None and os.path.lexists(out)
        t0 = time.perf_counter()
        code, text = self._run(job.module, argv, case, limit)
        took = time.perf_counter() - t0
        c = self.counts
        c.cases += 1
        c.slowest = max(c.slowest, took / self.normal[job_name])
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        what = f"{job_name} {case}"
        if code == "hang":
            c.hangs += 1
            c.notes.append(f"{what}: still running after {limit:.0f} s (3x its normal time), killed")
        elif "Traceback" in text:
            c.tracebacks += 1
            c.notes.append(f"{what}: traceback {text.strip().splitlines()[-1][:200]}")
        elif code == 0:
            if same is not None and same():
                c.accepted += 1
                c.accepted_cases.append(what)
            else:
                c.wrong_data_exits += 1
                c.notes.append(f"{what}: exit 0")
        elif code != 2 or len(errors) != 1 or needle not in errors[0]:
            c.failed += 1
            c.notes.append(f"{what}: exit {code}, {text.strip().splitlines()[-2:]}")
        elif out is not None and not existed and os.path.lexists(out):
            c.failed += 1
            c.notes.append(f"{what}: refused but wrote {out}")
        else:
            c.refused += 1

    # -- the cases ------------------------------------------------------------------------------
    def same_place(self) -> None:
        """--out spelled as the job's source (eval: its data file) three ways, with --overwrite."""
        for name, job in self.jobs.items():
            base = self.base / f"same-{name}"
            private = _private(job, base)
            flag = "--data-path" if name == "eval" else "--model"
            target = Path(private.argv[private.argv.index(flag) + 1])
            link, parent = base / "link", base / "parent-link"
            link.symlink_to(target)
            parent.symlink_to(target.parent)
            before = snapshot(target)
            spellings = {"a symbolic link to the input": str(link),
                         "a relative path with .. to the input": os.path.relpath(target, ROOT),
                         "a path through a linked parent": str(parent / target.name)}
            for what, out in spellings.items():
                argv = [*private.argv, "--out", out, *([] if name == "eval" else ["--overwrite"])]
                self.case(name, argv, f"--out {what}", needle="a job never writes over, inside or around what it reads")
            if snapshot(target) != before:
                self.counts.wrong_data_exits += 1
                self.counts.notes.append(f"{name}: the input {target} changed")
            shutil.rmtree(base, ignore_errors=True)

    def manifest_edits(self) -> None:
        """Every value of the converted model's manifest changed, one at a time, read by eval."""
        d = self.base / "manifest" / "converted"
        shutil.copytree(self.converted, d)
        original = (d / "cmoe_manifest.json").read_text()
        want = self._ppl(d)
        manifest = json.loads(original)
        for path, value in json_leaves(manifest):
            edited = json.loads(original)
            set_at(edited, path, changed_value(value))
            (d / "cmoe_manifest.json").write_text(json.dumps(edited, indent=1))
            self._eval_case(d, f"manifest {'.'.join(map(str, path))} {value!r:.20} -> {changed_value(value)!r:.20}",
                            want, needle="cmoe_manifest.json")
        (d / "cmoe_manifest.json").write_text(original)

    def config_values(self) -> None:
        """Every field of a dense model's config.json (and every required one) set to values of
        the wrong type or range, read by eval."""
        d = self.base / "config" / "dense"
        shutil.copytree(self.dense, d)
        original = (d / "config.json").read_text()
        fields = sorted(set(json.loads(original)) | {"model_type", "vocab_size", "hidden_size",
                                                     "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "rms_norm_eps", "rope_theta"})
        for name in fields:
            for value in ("big", -7, None, 2.5, [1], {"a": 1}, 0, float("1e308")):
                cfg = json.loads(original)
                cfg[name] = value
                (d / "config.json").write_text(json.dumps(cfg))
                # a value of the right type and range is a valid config, with its own result
                self._eval_case(d, f"config.json {name} = {value!r}", None, needle="config.json")
        (d / "config.json").write_text(original)

    def model_defects(self) -> None:
        """Model directories of every defect, read by eval and by convert."""
        for what, damage in DIR_DEFECTS.items():
            d = self.base / "dirs" / what.replace(" ", "-")
            shutil.copytree(self.dense, d)
            damage(d)
            self._model_case(d, f"model directory: {what}")
            shutil.rmtree(d)

    def gguf_defects(self) -> None:
        """GGUF files of every defect (truncated, of the wrong type, missing fields, missing or
        broken tokenizer fields), read by eval and by convert."""
        root = self.base / "gguf"
        root.mkdir()
        write_gguf(self.dense, root / "clean.gguf", {})
        want = self._ppl(root / "clean.gguf")
        for what, (fields, cut) in GGUF_DEFECTS.items():
            path = root / f"{what.replace(' ', '-')}.gguf"
            write_gguf(self.dense, path, fields)
            if cut is not None:
                data = path.read_bytes()
                path.write_bytes(data[:cut(len(data))])
            self._model_case(path, f"GGUF: {what}", want)

    def non_utf8_out(self) -> None:
        """--out whose name is bytes that are not UTF-8, for every job."""
        for name, job in self.jobs.items():
            out = self.base / "out-\udcff\udcfe"
            argv = job.command(out, resume=False)
            self.case(name, argv, "--out not UTF-8", out=out, needle="is not valid UTF-8")

    def no_text(self) -> None:
        """Texts that are no text, for every job that reads one."""
        texts = {"empty": b"", "blank": b" \n\n\t \n", "NUL bytes": b"\0" * 100_000,
                 "a byte order mark alone": b"\xef\xbb\xbf", "control characters": b"\x01\x02\x1b" * 3000}
        root = self.base / "texts"
        root.mkdir()
        for what, data in texts.items():
            path = root / f"{what.replace(' ', '-')}.txt"
            path.write_bytes(data)
            for name, job in self.jobs.items():
                argv = list(job.argv)
                if "--data-path" not in argv:
                    continue
                argv[argv.index("--data-path") + 1] = str(path)
                out = self.base / f"text-{name}"
                self.case(name, [*argv, "--out", str(out)], f"text: {what}", out=out, needle=str(path))

    # -- helpers --------------------------------------------------------------------------------------
    def _ppl(self, model: Path) -> float:
        result = self.base / "ppl.json"
        code, text = self._run("cmoe_jax.eval.cli", [*self._eval_argv(model), "--out", str(result)], "baseline")
        if code != 0:
            raise RuntimeError(f"eval of {model} failed: {text[-1000:]}")
        return json.loads(result.read_text())["ppl"]

    def _eval_argv(self, model) -> list:
        argv = list(self.jobs["eval"].argv)
        argv[argv.index("--model") + 1] = str(model)
        return argv

    def _eval_case(self, model: Path, case: str, want: float | None, needle: str) -> None:
        """eval of `model`: refused, or exit 0 with perplexity `want` (None: any result)."""
        result = self.base / "case.json"
        result.unlink(missing_ok=True)
        self.case("eval", [*self._eval_argv(model), "--out", str(result)], case, needle=needle,
                  same=lambda: result.is_file() and want in (None, json.loads(result.read_text())["ppl"]))

    def _model_case(self, model: Path, case: str, want: float = float("nan")) -> None:
        """eval and convert of a damaged model: refused, or, where eval found the model valid
        after all (the undamaged model's perplexity `want`), accepted by convert too."""
        accepted = self.counts.accepted
        self._eval_case(model, case, want, needle="")
        valid = self.counts.accepted > accepted
        convert = self.jobs["convert"]
        argv = list(convert.argv)
        argv[argv.index("--model") + 1] = str(model)
        out = self.base / "defect-out"
        self.case("convert", [*argv, "--out", str(out)], case, out=out, same=(lambda: True) if valid else None)
        _remove(out)

    def run_all(self) -> Counts:
        self.time_normal()
        for step in (self.same_place, self.non_utf8_out, self.no_text, self.model_defects,
                     self.gguf_defects, self.config_values, self.manifest_edits):
            step()
            print(json.dumps({"step": step.__name__, "cases": self.counts.cases, "hangs": self.counts.hangs,
                              "tracebacks": self.counts.tracebacks,
                              "wrong_data_exits": self.counts.wrong_data_exits,
                              "failed": self.counts.failed}), flush=True)
        return self.counts


def _remove(path: Path) -> None:
    for p in (path, path.with_name(path.name + ".partial")):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif os.path.lexists(p):
            p.unlink()


def json_leaves(obj, path=()):
    """(path, value) of every value in a JSON tree (an empty list or object counts as a value)."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from json_leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from json_leaves(v, (*path, i))
    else:
        yield path, obj


def changed_value(value):
    """Another value of the same kind: a number moved by one, a string changed, a flag flipped."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if value is None:
        return 1
    return [*value, 0] if isinstance(value, list) else {**value, "x": 0}


def set_at(tree, path, value):
    """`tree` with the value at `path` (keys and indices) replaced."""
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


# ---- model directories of every defect ---------------------------------------------------------------
def _rewrite(d: Path, name: str, data: bytes) -> None:
    (d / name).write_bytes(data)


def _truncate(d: Path, name: str, keep) -> None:
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[:keep(len(data))])


def _drop_tensor(d: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop(sorted(tensors)[-1])
    save_file(tensors, str(d / "model.safetensors"))


def _retype_tensor(d: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].astype("int32")
    save_file(tensors, str(d / "model.safetensors"))


def _config_dir(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


DIR_DEFECTS = {
    "no config.json": lambda d: (d / "config.json").unlink(),
    "config.json not JSON": lambda d: _rewrite(d, "config.json", b'{"model_type": "llama",'),
    "config.json not UTF-8": lambda d: _rewrite(d, "config.json", b'{"model_type": "ll\xffama"}'),
    "config.json a list": lambda d: _rewrite(d, "config.json", b"[1, 2]"),
    "config.json empty": lambda d: _rewrite(d, "config.json", b""),
    "config.json a directory": _config_dir,
    "no weights": lambda d: (d / "model.safetensors").unlink(),
    "weights truncated to half": lambda d: _truncate(d, "model.safetensors", lambda n: n // 2),
    "weights truncated to 10 bytes": lambda d: _truncate(d, "model.safetensors", lambda n: 10),
    "weights empty": lambda d: _truncate(d, "model.safetensors", lambda n: 0),
    "weights header of another size": lambda d: _rewrite(
        d, "model.safetensors", struct.pack("<Q", 1 << 40) + (d / "model.safetensors").read_bytes()[8:]),
    "a tensor missing": _drop_tensor,
    "a tensor of integers": _retype_tensor,
    "index naming a missing shard": lambda d: _rewrite(
        d, "model.safetensors.index.json", b'{"weight_map": {"lm_head.weight": "gone.safetensors"}}'),
    "tokenizer.json not JSON": lambda d: _rewrite(d, "tokenizer.json", b'{"version": '),
    "no tokenizer": lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")
                               if (d / n).exists()],
}


# ---- GGUF files of every defect --------------------------------------------------------------------------
def write_gguf(dense: Path, path: Path, fields: dict) -> None:
    """A llama GGUF of the dense model's weights (f32) with its vocabulary as a SentencePiece
    ("llama") tokenizer; `fields` {key: value} replace or add metadata
    (None: leave the key out; (vtype name, value): written as that GGUF type)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    cfg = json.loads((dense / "config.json").read_text())
    # the characters of the campaign's texts ("w17 w3 ..."), each a token of its own
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "w", *"0123456789"]
    tokens += [f"[PAD{i}]" for i in range(cfg["vocab_size"] - len(tokens))]
    meta = {"llama.block_count": ("UINT32", cfg["num_hidden_layers"]),
            "llama.context_length": ("UINT32", cfg["max_position_embeddings"]),
            "llama.embedding_length": ("UINT32", cfg["hidden_size"]),
            "llama.feed_forward_length": ("UINT32", cfg["intermediate_size"]),
            "llama.attention.head_count": ("UINT32", cfg["num_attention_heads"]),
            "llama.attention.head_count_kv": ("UINT32", cfg["num_key_value_heads"]),
            "llama.attention.layer_norm_rms_epsilon": ("FLOAT32", cfg["rms_norm_eps"]),
            "llama.rope.freq_base": ("FLOAT32", 10000.0), "llama.vocab_size": ("UINT32", cfg["vocab_size"]),
            "tokenizer.ggml.model": ("STRING", "llama"), "tokenizer.ggml.tokens": ("ARRAY:STRING", tokens),
            "tokenizer.ggml.scores": ("ARRAY:FLOAT32", [-1.0] * len(tokens)),
            "tokenizer.ggml.unknown_token_id": ("UINT32", 0),
            "tokenizer.ggml.token_type": ("ARRAY:INT32", [2, 3, 3] + [1] * (len(tokens) - 3)),
            "tokenizer.ggml.bos_token_id": ("UINT32", 1)}
    meta.update(fields)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, item in meta.items():
        if item is None:
            continue
        kind, value = item
        if kind.startswith("ARRAY:"):
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, getattr(gguf.GGUFValueType, kind[6:]))
        else:
            w.add_key_value(key, value, getattr(gguf.GGUFValueType, kind))
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, t in sorted(load_file(str(dense / "model.safetensors")).items()):
        t = np.asarray(t, np.float32)
        if name in top:
            w.add_tensor(top[name], t)
            continue
        _, _, i, rest = name.split(".", 3)
        mod = rest.rsplit(".", 1)[0]
        n = heads if mod == "self_attn.q_proj" else kv if mod == "self_attn.k_proj" else 0
        if n:  # llama.cpp's interleaved RoPE rows
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(f"blk.{i}.{names[mod]}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_DEFECTS = {  # what: (metadata changes, how the file is cut or None)
    "truncated to half": ({}, lambda n: n // 2),
    "truncated inside its metadata": ({}, lambda n: 200),
    "truncated to its magic": ({}, lambda n: 4),
    "empty": ({}, lambda n: 0),
    "block_count a string": ({"llama.block_count": ("STRING", "two")}, None),
    "block_count a float": ({"llama.block_count": ("FLOAT32", 2.0)}, None),
    "embedding_length negative": ({"llama.embedding_length": ("INT32", -32)}, None),
    "head_count zero": ({"llama.attention.head_count": ("UINT32", 0)}, None),
    "head_count_kv not dividing": ({"llama.attention.head_count_kv": ("UINT32", 3)}, None),
    "rms epsilon missing": ({"llama.attention.layer_norm_rms_epsilon": None}, None),
    "rms epsilon a string": ({"llama.attention.layer_norm_rms_epsilon": ("STRING", "small")}, None),
    "rope base infinite": ({"llama.rope.freq_base": ("FLOAT32", float("inf"))}, None),
    "context_length missing": ({"llama.context_length": None}, None),
    "unknown architecture": ({"general.architecture": ("STRING", "gpt9")}, None),
    "architecture a number": ({"general.architecture": ("UINT32", 7)}, None),
    "tokenizer tokens missing": ({"tokenizer.ggml.tokens": None}, None),
    "tokenizer tokens of numbers": ({"tokenizer.ggml.tokens": ("ARRAY:INT32", list(range(96)))}, None),
    "tokenizer model missing": ({"tokenizer.ggml.model": None}, None),
    "tokenizer model unknown": ({"tokenizer.ggml.model": ("STRING", "nonesuch")}, None),
    "tokenizer token types missing": ({"tokenizer.ggml.token_type": None}, None),
    "tokenizer scores missing": ({"tokenizer.ggml.scores": None}, None),
    "tokenizer bos id beyond the vocabulary": ({"tokenizer.ggml.bos_token_id": ("UINT32", 10_000)}, None),
    "vocab_size missing, tokens missing": ({"llama.vocab_size": None, "tokenizer.ggml.tokens": None}, None),
}
