"""Environments and a chat tokenizer for the multi-turn tests (importable as ``tests.helpers.episode_env:...`` by
launched runs, whose working directory is the repository)."""
import string

from grpo_accel.rollout.episodes import Step

# ChatML's shape with the tiny tokenizer's special tokens: the model's turn ends on <eos>, the template adds "\n".
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CHARS = string.digits + string.ascii_letters + " +-*/=<>{}[]()\":,._\n"
ROWS = [{"prompt": p, "answer": "0"} for p in ("1+1=", "22+2=", "3+33=", "4", "55*5", "6-6=")]
"""Prompts whose episodes take 1 to 3 turns under :class:`Countdown`."""


def chat_tokenizer():
    """A character tokenizer covering tool-call JSON, with :data:`TEMPLATE` as its chat template."""
    from grpo_accel.tasks.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(CHARS)
    tokenizer.chat_template = TEMPLATE
    return tokenizer


class Countdown:
    """Answers each model turn with a tool message "left <n>" until the episode has had 1 + (prompt length mod
    3) model turns, so that rows differ; each answer adds 0.1 to the reward term "answered". It has no tools:
    any environment works, not only tool environments."""

    tools = ()

    def reset(self, row: dict) -> list[dict]:
        self.turns = 1 + len(row["prompt"]) % 3
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[dict]) -> Step:
        taken = sum(m["role"] == "assistant" for m in messages)
        if taken >= self.turns:
            return Step(done=True)
        return Step([{"role": "tool", "content": f"left {self.turns - taken}"}], rewards={"answered": 0.1},
                    tool_calls=1)


def short_turn_model(tokenizer, steps: int = 150, seed: int = 0):
    """The tiny Llama taught (a few seconds of Adam) to answer in one to three characters and end its turn with
    <eos>: a model, not a hook, that takes several turns in an episode (SGLang's stand-in serves it)."""
    import random

    import torch

    from grpo_accel.tasks.tiny import build_tiny_model

    rng = random.Random(seed)
    model = build_tiny_model(tokenizer, seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    word = lambda: "".join(rng.choice("abc123") for _ in range(rng.randint(1, 3)))  # noqa: E731
    for _ in range(steps):
        texts = [tokenizer.apply_chat_template(
            [{"role": "user", "content": word()}, {"role": "assistant", "content": word()},
             {"role": "tool", "content": f"left {rng.randint(1, 2)}"}, {"role": "assistant", "content": word()}],
            tokenize=False) for _ in range(16)]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()
