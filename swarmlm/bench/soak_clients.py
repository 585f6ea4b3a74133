"""The soak's clients (benchmarks/soak.py): one process per client, each a loop of one kind of request checked
against plain transformers on the same checkpoint, one JSON line per request on stdout, until its stop file appears.

Kinds: `greedy` (generate), `sampling` (seeded top-k: the same seed gives transformers' tokens), `speculative`
(generate with speculative="auto": transformers' greedy tokens), `beam` (2 beams), `api` (a streamed completion of
n=2 choices through the gateway: transformers' greedy text, twice), `train` (LoRA: a fresh adapter's loss through 4
AdamW steps, each PEFT's on transformers from the same adapter).

    python -m swarmlm.bench.soak_clients KIND MODEL_DIR STOP_FILE SEED [--initial-peers ...]
        [--gateway URL --gateway-model ID]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

KINDS = ("greedy", "sampling", "speculative", "beam", "api", "train")
NEW_TOKENS = 12
TRAIN_STEPS = 4  # AdamW steps per fresh adapter
TRAIN_LR = 1e-2


def prompts(tok, rng: random.Random) -> torch.Tensor:
    """A prompt of 3..24 random tokens (a fresh one each request: no two requests share their answer)."""
    n = rng.randint(3, 24)
    return torch.tensor([[rng.randrange(3, tok.vocab_size) for _ in range(n)]])


class Checker:
    """One kind's request, made on the swarm and on transformers (`ref`), compared."""

    def __init__(self, kind: str, model_dir: str, peers: list[str], gateway: str, gateway_model: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from swarmlm import DistributedModelForCausalLM

        self.kind, self.gateway, self.gateway_model, self.model_dir = kind, gateway, gateway_model, model_dir
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.ref = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        self.model = None
        if kind != "api":
            extra = {"tuning_mode": "lora", "lora_r": 4} if kind == "train" else {}
            self.model = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers,
                                                                     dtype="float32", **extra)

    def run(self, ids: torch.Tensor, seed: int) -> str | None:
        """None when the swarm's answer is transformers', else what differs."""
        return getattr(self, f"_{self.kind}")(ids, seed)

    def _both(self, ids: torch.Tensor, seed: int, **kwargs) -> tuple[list, list]:
        out = []
        for m in (self.model, self.ref):
            torch.manual_seed(seed)
            with torch.no_grad():
                out.append(m.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      pad_token_id=self.tok.eos_token_id, **kwargs)[:, ids.shape[1]:].tolist())
        return out[0], out[1]

    def _verdict(self, got, want) -> str | None:
        return None if got == want else f"got {got}, want {want}"

    def _up_to_ties(self, ids: torch.Tensor, got: list[int], want: list[int], tolerance: float = 1e-3) -> str | None:
        """A greedy continuation computed in other shapes (speculative verification passes, the gateway's batches):
        every token of `got` within `tolerance` of its position's best logit (transformers' forward of the whole
        sequence), and `got` equal to `want` up to the first near-tie of `want` (as tests/swarm_helpers.py
        assert_greedy_up_to_ties)."""
        if got == want:
            return None
        prompt = ids[0].tolist()
        with torch.no_grad():
            logits = self.ref(torch.tensor([prompt + got])).logits[0, len(prompt) - 1:-1].float()
            ref_top2 = self.ref(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1].float().topk(2).values
        best = logits.max(dim=-1).values
        chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        if bool((best - chosen > tolerance * best.abs().clamp_min(1.0)).any()):
            return f"not the argmax: got {got}, want {want}"
        clear = (ref_top2[:, 0] - ref_top2[:, 1]) > tolerance * ref_top2[:, 0].abs().clamp_min(1.0)
        first_tie = int((~clear).nonzero()[0]) if bool((~clear).any()) else len(want)
        return None if got[:first_tie] == want[:first_tie] else f"got {got}, want {want} (first tie at {first_tie})"

    def _greedy(self, ids, seed):
        return self._verdict(*self._both(ids, seed))

    def _sampling(self, ids, seed):
        return self._verdict(*self._both(ids, seed, do_sample=True, top_k=20, temperature=0.8))

    def _beam(self, ids, seed):
        return self._verdict(*self._both(ids, seed, num_beams=2))

    def _speculative(self, ids, seed):
        # the same pad_token_id on both sides: without it, a prompt holding the checkpoint's pad id (3; prompts draw
        # from 3..vocab) is read as padded there (transformers masks those tokens, and so does the swarm), and the
        # answer differs from the reference's, which was given eos as pad. The hour's soak of 5 December counted
        # those as 40 "wrong" speculative answers (all 40 held token 3); no swarm answer was wrong
        with torch.no_grad():
            got = self.model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, speculative="auto",
                                      pad_token_id=self.tok.eos_token_id)[:, ids.shape[1]:].tolist()
            want = self.ref.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=self.tok.eos_token_id)[:, ids.shape[1]:].tolist()
        return self._up_to_ties(ids, got[0], want[0])  # (drafts are verified in passes of several tokens)

    def _api(self, ids, seed):
        """The prompt as text (the gateway tokenizes it as `tokenizer(text)`); greedy, n=2, streamed."""
        import httpx2 as httpx

        text = self.tok.decode(ids[0], skip_special_tokens=True)
        ids = self.tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            new = self.ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=self.tok.eos_token_id)[0, ids.shape[1]:]
        want = self.tok.decode(new, skip_special_tokens=True)
        body = {"model": self.gateway_model, "prompt": text, "max_tokens": NEW_TOKENS, "temperature": 0, "n": 2,
                "stream": True}
        texts = ["", ""]
        with httpx.Client(timeout=300) as http:
            with http.stream("POST", f"{self.gateway}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:200]!r}")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        raise RuntimeError(f"stream error: {str(msg['error'])[:200]}")
                    for choice in msg["choices"]:
                        texts[choice["index"]] += choice["text"]
        for text in texts:  # the n rows go as one batch (not bit-identical to one row): equal up to ties
            got = self.tok(text, add_special_tokens=False).input_ids if text != want else new.tolist()
            if self.tok.decode(got, skip_special_tokens=True) != text:
                return f"got {texts}, want {want!r} (not re-tokenizable)"
            if why := self._up_to_ties(ids, got, new.tolist()):
                return f"{why}: got {texts}, want {want!r}"
        return None

    def _train(self, ids, seed):
        """A fresh LoRA (A random, B = 0), then TRAIN_STEPS AdamW steps on the same batch: every loss must be the one
        PEFT on transformers gives from the same adapter with the same optimizer (a loss may rise: the hour's soak
        of 5 December saw 5 loops whose last loss rose above the first, and PEFT's losses rise the same, bit for
        bit: docs/RESULTS-soak.md)."""
        torch.manual_seed(seed)
        for name, p in self.model.named_parameters():  # a fresh adapter: A random, B zero (as PEFT's)
            if p.requires_grad:
                with torch.no_grad():
                    p.zero_() if ".b." in name else p.normal_(std=0.1)
        want = peft_losses(self.model, self.model_dir, ids)  # (from the same initial adapter)
        opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=TRAIN_LR)
        losses = []
        for _ in range(TRAIN_STEPS + 1):
            opt.zero_grad()
            loss = self.model(ids, labels=ids).loss
            losses.append(loss.item())
            loss.backward()
            opt.step()
        if any(abs(got - w) > 1e-3 * max(1.0, abs(w)) for got, w in zip(losses, want)):
            return f"losses {losses}, PEFT's on transformers {want}"
        return None


def peft_losses(model, model_dir: str, ids: torch.Tensor, steps: int = TRAIN_STEPS) -> list[float]:
    """The losses of `steps` AdamW steps (lr TRAIN_LR) on `ids` of PEFT on transformers, from `model`'s LoRA now."""
    import tempfile

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from swarmlm.client.tuning import save_adapter

    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(model, tmp, model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, tmp, is_trainable=True)
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=TRAIN_LR)
    losses = []
    for _ in range(steps + 1):
        opt.zero_grad()
        loss = peft(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=KINDS)
    p.add_argument("model_dir")
    p.add_argument("stop_file")
    p.add_argument("seed", type=int)
    p.add_argument("--initial-peers", nargs="*", default=[])
    p.add_argument("--gateway", default="")
    p.add_argument("--gateway-model", default="")
    p.add_argument("--pause-s", type=float, default=1.0, help="between requests")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    checker = Checker(args.kind, args.model_dir, args.initial_peers, args.gateway, args.gateway_model)
    rng = random.Random(args.seed)
    print(json.dumps({"event": "ready"}), flush=True)
    try:
        while not Path(args.stop_file).exists():
            ids, seed, t0 = prompts(checker.tok, rng), rng.randrange(1 << 30), time.time()
            try:
                wrong, error = checker.run(ids, seed), None
            except Exception as exc:  # a request that failed: with its error (the harness counts it)
                wrong, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            print(json.dumps({"kind": args.kind, "t": t0, "s": round(time.time() - t0, 3), "ok": error is None and
                              wrong is None, "wrong": wrong, "error": error}), flush=True)
            time.sleep(args.pause_s)
    finally:
        if checker.model is not None:
            checker.model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
