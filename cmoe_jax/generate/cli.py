"""`python -m cmoe_jax.generate`: text continuations (or chat answers) of a dense or converted
model, with the KV-cache generation of `cmoe_jax.generate.engine`.

One prompt streams its answer to stdout as it is made; several print one JSON object a line
(`prompt`, `completion`, `tokens`, `finish`: "stop" or "length") once all are done. Arguments,
the prompts file and the model path are checked before any weight is loaded; bad input prints
one `error: ...` line on stderr and exits with status 2.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from cmoe_jax.cli_args import (Parser, add_model, add_seed, check_readable_file, command_main, nonneg_float,
                               nonneg_int, positive_float, positive_int)
from cmoe_jax.errors import CmoeError


EXAMPLE = "{prog} --chat --prompt 'What is the capital of France?' --max-new-tokens 64"


def build_parser(prog: str = "python -m cmoe_jax.generate") -> Parser:
    p = Parser(prog, "Generate text with a dense or converted model (KV cache, batched).",
               EXAMPLE.format(prog=prog))
    add_model(p, what="model to generate with")
    g = p.add_argument_group("prompts", "give --prompt (repeatable) or --prompts-file")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts-file", metavar="FILE", help="a text file of prompts, one a line (blank lines skipped)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat "
                                                       "template as a user message")
    s = p.add_argument_group("generation")
    s.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate at most")
    s.add_argument("--temperature", type=nonneg_float, default=0.0, help="0: greedy; > 0: sampling")
    s.add_argument("--top-k", type=nonneg_int, default=0, help="sample among the k most likely tokens (0: all)")
    s.add_argument("--top-p", type=positive_float, default=1.0, help="sample among the smallest set of tokens of "
                                                             "probability >= p, in (0, 1] (1: all)")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable): the answer "
                                                               "ends before its first occurrence")
    s.add_argument("--batch-size", type=positive_int, default=8, help="prompts generated together")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    add_seed(p)
    return p


def parse_args(argv=None, prog: str = "python -m cmoe_jax.generate"):
    return build_parser(prog).parse_args(argv)


def _prompts(args) -> list[str]:
    if bool(args.prompt) == bool(args.prompts_file):
        raise CmoeError("give the prompts with --prompt (repeatable) or with --prompts-file, one of the two")
    if args.prompt:
        return list(args.prompt)
    check_readable_file(args.prompts_file, "--prompts-file")
    path = Path(args.prompts_file).expanduser()
    try:
        prompts = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]  # BOM dropped
    except UnicodeDecodeError as e:
        raise CmoeError(f"--prompts-file {path} is not UTF-8 text (byte {e.start}): save it as "
                        "UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if not prompts:
        raise CmoeError(f"--prompts-file {path} holds no prompt (one a line)")
    return prompts


def _validate(args):
    from cmoe_jax.generate.engine import Sampling

    if args.max_new_tokens < 1:
        raise CmoeError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.batch_size < 1:
        raise CmoeError(f"--batch-size must be at least 1, got {args.batch_size}")
    if any(not s for s in args.stop):
        raise CmoeError("--stop needs a non-empty string")
    try:
        return Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        raise CmoeError(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p")
                        .replace("temperature", "--temperature", 1)) from None


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as one user message in the tokenizer's chat template, ready for the answer."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if not getattr(hf, "chat_template", None):
        raise CmoeError("--chat: this model's tokenizer has no chat template; drop --chat")
    return hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                  add_generation_prompt=True)


def stop_token_ids(tokenizer, chat: bool) -> list[int]:
    """The end-of-sequence token, and in chat the template's end-of-turn token."""
    hf = getattr(tokenizer, "hf", tokenizer)
    ids = {hf.eos_token_id} if getattr(hf, "eos_token_id", None) is not None else set()
    if chat:
        for token in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = hf.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != getattr(hf, "unk_token_id", None) and tid >= 0:
                ids.add(tid)
    return sorted(ids)


class Completion:
    """A row's text as it grows: the decoded tokens (stop tokens left out) cut before the
    first stop string; `ready()` is the part that can no longer change (streaming)."""

    def __init__(self, tokenizer, stops: list[str], stop_ids: list[int]):
        self.tokenizer, self.stops, self.stop_ids = tokenizer, stops, set(stop_ids)
        self.ids: list[int] = []
        self.shown = 0

    def add(self, token: int) -> None:
        self.ids.append(token)

    def text(self) -> str:
        text = self.tokenizer.decode([t for t in self.ids if t not in self.stop_ids])
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def stopped(self) -> bool:
        text = self.tokenizer.decode([t for t in self.ids if t not in self.stop_ids])
        return any(s in text for s in self.stops)

    def ready(self, final: bool) -> str:
        """The new text since the last call that later tokens cannot change."""
        text = self.text()
        if not final:
            hold = max((len(s) - 1 for s in self.stops), default=0)
            text = text[:max(self.shown, len(text) - hold)].rstrip("\ufffd")
        new, self.shown = text[self.shown:], max(self.shown, len(text))
        return new


def run(args) -> dict:
    sampling = _validate(args)
    prompts = _prompts(args)
    from cmoe_jax.loading import load_config, load_tokenizer

    cfg, path = load_config(args.model)
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise CmoeError(f"{path} has no tokenizer (tokenizer.json / tokenizer.model): "
                        "copy the source model's tokenizer files next to its weights")
    texts = [chat_prompt(tokenizer, p) for p in prompts] if args.chat else prompts
    ids = [tokenizer.encode(t) for t in texts]
    if any(not i for i in ids):
        raise CmoeError("a prompt encodes to no token: give a non-empty prompt")
    if args.top_k > cfg.vocab_size:
        raise CmoeError(f"--top-k {args.top_k} exceeds the model's vocabulary of {cfg.vocab_size} tokens: "
                        f"give at most {cfg.vocab_size} (0: all)")
    if args.max_new_tokens >= cfg.max_position_embeddings:
        raise CmoeError(f"--max-new-tokens {args.max_new_tokens} must be below the model's context of "
                        f"{cfg.max_position_embeddings} tokens")
    import jax.numpy as jnp

    from cmoe_jax.generate.engine import Decoding, generate
    from cmoe_jax.loading import load_model

    model = load_model(args.model, dtype=getattr(jnp, args.dtype), progress=False).model
    stop_ids = stop_token_ids(tokenizer, args.chat)
    rows = [Completion(tokenizer, args.stop, stop_ids) for _ in prompts]
    stream = len(prompts) == 1

    def on_token(i, token):
        rows[i].add(token)
        if stream:
            sys.stdout.write(rows[i].ready(final=False))
            sys.stdout.flush()

    start = time.perf_counter()
    by_string = (lambda out: _stopped_by_string(tokenizer, args.stop, out)) if args.stop else None
    decoding = Decoding(args.max_new_tokens, sampling, stop_ids, by_string, batch_size=args.batch_size)
    outputs = generate(model, ids, decoding, on_token=on_token)
    seconds = time.perf_counter() - start
    if stream:
        print(rows[0].ready(final=True), flush=True)
    results = [{"prompt": p, "completion": r.text(), "tokens": len(o),
                "finish": "stop" if (o and o[-1] in stop_ids) or r.stopped() else "length"}
               for p, r, o in zip(prompts, rows, outputs)]
    if not stream:
        for result in results:
            print(json.dumps(result, ensure_ascii=False), flush=True)
    total = sum(len(o) for o in outputs)
    print(f"{total} tokens in {seconds:.1f} s ({total / seconds:.1f} tokens/s, compile included)",
          file=sys.stderr)
    return {"results": results, "seconds": seconds}


def _stopped_by_string(tokenizer, stops, ids) -> bool:
    text = tokenizer.decode(ids)
    return any(s in text for s in stops)


def main(argv=None, prog: str = "python -m cmoe_jax.generate") -> int:
    return command_main(parse_args, run, None, argv, prog)
