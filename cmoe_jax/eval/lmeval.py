"""lm-evaluation-harness backend `cmoe_jax` (needs `pip install -e '.[lmeval]'`).

    python -m cmoe_jax.eval.lmeval --model DIR --tasks arc_easy
    python -m cmoe_jax.eval.lmeval --model cmoe_jax --model_args pretrained=DIR --tasks arc_easy

is `lm_eval` with this backend registered (lm-eval 0.4.13 finds external models only once
their module is imported; it has no plugin entry points). From Python, `import
cmoe_jax.eval.lmeval` before `lm_eval.simple_evaluate(model="cmoe_jax", ...)`.

Model arguments: pretrained (anything `load_model` takes: HF dir, .gguf, converted or
fine-tuned cmoe_jax dir, `smollm2`), dtype (float32 | bfloat16), batch_size (sequences per
step, default 32), max_length (default: the model's context), max_gen_toks (default 256).
Tokenisation, context/continuation splitting and rolling windows are lm-eval's own
(`TemplateLM`); the scoring is `cmoe_jax.eval.loglikelihood.score_requests`.
"""
from __future__ import annotations

import sys

from cmoe_jax.errors import EXIT_BAD_INPUT, MissingDependencyError, require

try:  # an extra: without it, one error line naming the extra (exit 2), not a traceback
    require("lm_eval.models", "lmeval", "the lm-evaluation-harness backend `cmoe_jax`")
except MissingDependencyError as e:
    if __name__ != "__main__":
        raise
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)

import lm_eval.models  # noqa: E402,F401  (registers the built-in backends first: get_model fills an empty registry only)
from lm_eval import utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from cmoe_jax.generate import Decoding, generate  # noqa: E402
from cmoe_jax.eval.loglikelihood import score_requests  # noqa: E402


def _special_id(tokenizer, name: str):
    """A special token id of our tokenizer wrapper (or the Hugging Face tokenizer it wraps)."""
    value = getattr(tokenizer, name, None)
    if value is None and hasattr(tokenizer, "hf"):
        value = getattr(tokenizer.hf, name, None)
    return value


@register_model("cmoe_jax")
class CmoeJaxLM(TemplateLM):
    """A cmoe_jax model (dense, converted or LoRA-merged) as an lm-eval `LM`."""

    def __init__(self, pretrained: str = "smollm2", dtype: str = "float32", batch_size=32,
                 max_length=None, max_gen_toks: int = 256, progress: bool = True, **_ignored):
        super().__init__()
        import jax.numpy as jnp

        from cmoe_jax.loading import load_model

        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype!r}")
        self.lm = load_model(str(pretrained), dtype=getattr(jnp, dtype), progress=progress)
        if self.lm.tokenizer is None:
            raise ValueError(f"{pretrained} has no tokenizer: copy the source model's tokenizer files beside it")
        self.batch_size = 32 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = int(max_length) if max_length else self.lm.config.max_position_embeddings
        self.max_gen_toks = int(max_gen_toks)
        self.progress = progress

    @property
    def eot_token_id(self) -> int:
        return _special_id(self.lm.tokenizer, "eos_token_id")

    @property
    def prefix_token_id(self) -> int:  # as lm-eval's HF backend: BOS, else EOS
        bos = _special_id(self.lm.tokenizer, "bos_token_id")
        return self.eot_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return str(self.lm.path)

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return list(self.lm.tokenizer.encode(string))

    def tok_decode(self, tokens) -> str:
        return self.lm.tokenizer.decode(tokens)

    def _score(self, requests, disable_tqdm: bool, desc: str):
        results, _ = score_requests(self.lm.model, requests, batch_size=self.batch_size,
                                    max_length=self.max_length, desc=desc,
                                    progress=self.progress and not disable_tqdm)
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """requests: ((context, continuation), context_ids, continuation_ids) from lm-eval."""
        results = self._score([(ctx, cont) for _, ctx, cont in requests], disable_tqdm, "loglikelihood")
        for (pair, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", pair, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Summed log-likelihood of whole strings in disjoint windows of max_length (as HFLM)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(window)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._score(windows, disable_tqdm, "loglikelihood_rolling")):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, cut at the first `until` string (sampling is not supported).
        Requests sharing their stop strings and length are generated together, in batches of
        `batch_size`, with the KV cache (`cmoe_jax.generate`)."""
        groups: dict[tuple, list[int]] = {}
        for i, req in enumerate(requests):
            kwargs = dict(req.args[1] or {})
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) not in (0, 0.0, None):
                raise ValueError("the cmoe_jax backend generates greedily only (do_sample=False, temperature=0)")
            until = kwargs.get("until") or [self.tok_decode([self.eot_token_id])]
            until = (until,) if isinstance(until, str) else tuple(until)
            groups.setdefault((until, int(kwargs.get("max_gen_toks", self.max_gen_toks))), []).append(i)
        eot = self.eot_token_id
        out: list[str] = [""] * len(requests)
        for (until, max_new), members in groups.items():
            stop = lambda ids, until=until: any(u in self.tok_decode(ids) for u in until)
            contexts = [self.tok_encode(requests[i].args[0]) for i in members]
            decoding = Decoding(max_new, stop_tokens=[eot], stop=stop, max_length=self.max_length,
                                batch_size=self.batch_size)
            generated = generate(self.lm.model, contexts, decoding,
                                 progress=self.progress and not disable_tqdm)
            for i, ids in zip(members, generated):
                text = self.tok_decode([t for t in ids if t != eot])
                for u in until:
                    text = text.split(u)[0]
                out[i] = text
        for req, text in zip(requests, out):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out


# our shared spellings -> lm-eval's own (lm-eval writes its flags with underscores)
_SPELLINGS = {"--task": "--tasks", "--backend": "--model", "--model-args": "--model_args",
              "--batch-size": "--batch_size", "--output-path": "--output_path", "--out": "--output_path",
              "--json": "--output_path"}
HELP = """cmoe_jax additions (translated before lm-eval parses the command line):
  --model PATH     a model path, Hub id or 'smollm2' (as in every cmoe_jax command) means
                   --model cmoe_jax --model_args pretrained=PATH; an lm-eval backend name
                   (cmoe_jax, hf, ...) keeps lm-eval's meaning
  --backend NAME   the lm-eval backend (lm-eval's --model; default cmoe_jax)
  --task, --out, --json, --output-path, --model-args, --batch-size: aliases of lm-eval's
                   --tasks, --output_path, --model_args, --batch_size
example:
  python -m cmoe_jax.eval.lmeval --model out/s3a3e8 --tasks arc_easy --limit 100 --output-path arc/
"""


def translate_argv(argv: list[str]) -> list[str]:
    """Our spellings and a model path after --model turned into lm-eval's command line."""
    from lm_eval.api.registry import MODEL_REGISTRY

    if argv and argv[0] in ("run", "ls", "validate"):  # lm-eval's subcommands stay first
        rest = translate_argv(argv[1:]) if argv[0] == "run" else argv[1:]
        return [argv[0], *rest]
    out, pretrained, backend = [], None, None
    i = 0
    while i < len(argv):
        arg, value = argv[i], None
        name, eq, inline = arg.partition("=")
        if name in ("--model", "--backend", "-M"):
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            i += 1 if eq else 2
            if value is None:
                out.append(name)  # lm-eval reports the missing value
            elif name == "--backend" or value in MODEL_REGISTRY:
                backend = value
            else:
                pretrained = value
            continue
        out.append(_SPELLINGS.get(name, name) + (eq + inline if eq else ""))
        i += 1
    if pretrained is not None:
        out += ["--model_args", f"pretrained={pretrained}"]
    if backend is not None or pretrained is not None or not any(a in ("-h", "--help") for a in argv):
        out = ["--model", backend or "cmoe_jax", *out]
    return out


def build_parser():
    """lm-eval's `run` parser (for checking a command line without running it)."""
    from lm_eval._cli import HarnessCLI

    return HarnessCLI()._subparsers.choices["run"]


def parse_args(argv=None, prog: str = "python -m cmoe_jax.eval.lmeval"):
    argv = translate_argv(sys.argv[1:] if argv is None else list(argv))
    return build_parser().parse_args(argv[1:] if argv[:1] == ["run"] else argv)


def main(argv=None, prog: str = "python -m cmoe_jax.eval.lmeval") -> int:
    """`lm_eval`'s command line with the `cmoe_jax` backend registered and our spellings accepted."""
    from lm_eval.__main__ import cli_evaluate

    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(HELP)
        argv = ["run", "--help"]  # lm-eval's evaluation flags, not its list of subcommands
    sys.argv = [prog, *translate_argv(argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
