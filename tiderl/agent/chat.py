"""Token assembly with a tokenizer's own chat template.

The agent loop builds each episode's token sequence piece by piece: the rendered prompt, then
for every turn the engine's sampled tokens (never re-tokenized) followed by the tokens of the
environment's answer. Those answer tokens must be exactly what the chat template would put
after the assistant turn, so that the whole sequence is the template's rendering of the whole
conversation. `ChatFormat` derives them from the template itself by rendering a reference
conversation with and without the new messages and keeping the difference; this works for any
Hugging Face tokenizer whose template renders earlier turns the same way whatever follows them
(prefix-consistent), and raises `TemplateError` naming the problem for one that does not.

Everything rendered is made valid text first (`text.valid_text`): whatever an environment or a
model put in a message (a lone surrogate echoed from a tool argument), the tokenizer can encode
it.

With a vision-language model's processor in place of the tokenizer, a message may be an
`Observation` (images, then text): it renders as image parts, and the rendered text is encoded by
the processor, which expands each image placeholder into that image's tokens exactly once
(`*_with_images` methods; docs/multimodal.md).
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from tiderl.agent.text import valid_text
from tiderl.envs.protocol import Observation
from tiderl.models.vision import IMAGE_PLACEHOLDER, split_processor

# The reference conversation: placeholders no template and no real message will contain.
_REF_SYSTEM = "tiderl reference system message"
_REF_USER = "tiderl reference user message"
_REF_ASSISTANT = "tiderl reference assistant turn"

# The user turn appended when an environment neither ends the episode nor returns any
# observation (the turn had no tool call): a chat template needs a message between two
# assistant turns, and the agent needs a nudge to go on.
CONTINUE_MESSAGE = "Continue."


class TemplateError(ValueError):
    """The tokenizer's chat template cannot be used for incremental token assembly."""


class ChatFormat:
    """Prompt and observation tokens for one tokenizer and one tool list.

    `end_of_turn`: the token string that ends an assistant turn. By default it is found in the
    template's own rendering of an assistant turn (the special token right after the content,
    preferring `tokenizer.eos_token`); pass it when a template is ambiguous.

    Construction checks that the template is prefix-consistent: rendering the prompt with a
    generation prompt, appending an assistant turn's content and the end-of-turn token, gives
    the same text as rendering the conversation with that assistant turn. Rendered text is
    encoded without added special tokens: it holds every one the model expects (a BOS included).
    """

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None, end_of_turn: str | None = None):
        # A multi-modal processor brings its tokenizer; the processor encodes messages with images.
        tokenizer, self.processor = split_processor(tokenizer)
        self.tokenizer = tokenizer
        # An empty tool list is passed as None: some templates print an empty tools section for [].
        self.tools = tools or None
        base = [{"role": "system", "content": _REF_SYSTEM}, {"role": "user", "content": _REF_USER}]
        assistant = {"role": "assistant", "content": _REF_ASSISTANT}
        prompt_text = self.render(base, add_generation_prompt=True)
        with_turn = self.render([*base, assistant], add_generation_prompt=False)
        turn_start = prompt_text + _REF_ASSISTANT
        if not with_turn.startswith(turn_start):
            raise TemplateError(
                "the chat template is not prefix-consistent: the prompt rendered with "
                "add_generation_prompt=True followed by the assistant's content is not how the template "
                f"renders that assistant turn.\nprompt + content: {turn_start!r}\ntemplate: {with_turn!r}"
            )
        self.end_of_turn = end_of_turn or self._find_end_of_turn(with_turn[len(turn_start) :])
        if not with_turn[len(turn_start) :].startswith(self.end_of_turn):
            raise TemplateError(
                f"the chat template does not close an assistant turn with {self.end_of_turn!r} right after "
                f"its content (it renders {with_turn[len(turn_start):]!r}); pass the right end_of_turn"
            )
        ids = tokenizer.encode(self.end_of_turn, add_special_tokens=False)
        if len(ids) != 1:
            raise TemplateError(
                f"end-of-turn {self.end_of_turn!r} encodes to {len(ids)} tokens {ids}; it must be one "
                "special token so that a sampled turn can end on it"
            )
        self.end_of_turn_id: int = ids[0]
        # Everything the template renders up to and including the reference turn's end-of-turn
        # token; new messages are rendered after it and the text beyond it is what they add.
        self._base = base
        self._assistant = assistant
        self._turn_prefix = turn_start + self.end_of_turn

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """The template's text for `messages` (with this format's tools), as valid text: code
        points UTF-8 cannot encode are replaced (`valid_text`), so it always tokenizes."""
        return valid_text(self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        ))

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation so far followed by the generation prompt, as token ids."""
        return _text_only(self.prompt_with_images(messages), "prompt_with_images")

    def prompt_with_images(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[Any]]:
        """`prompt_ids` of messages whose content may be an `Observation`: the ids (each image's
        placeholder expanded by the processor) and the images in placeholder order."""
        messages, images = self.with_parts(messages)
        return self._encode(self.render(messages, add_generation_prompt=True), images), images

    def answer_ids(self, observations: list[str], continue_message: str = CONTINUE_MESSAGE,
                   as_tool_responses: bool = True) -> list[int]:
        """The tokens of an environment's answer to a turn, as an episode gets them: the
        observations as tool messages (`continuation_ids`), or, when the turn called no tool
        (`as_tool_responses=False`), joined into one user turn; `continue_message` as a user turn
        when there is none. TypeError, naming the problem, when `observations` is not a list of
        text (a bug of the environment, not of the model)."""
        return _text_only(self.answer_with_images(observations, continue_message, as_tool_responses),
                          "answer_with_images")

    def answer_with_images(self, observations: list[str | Observation], continue_message: str = CONTINUE_MESSAGE,
                           as_tool_responses: bool = True) -> tuple[list[int], list[Any]]:
        """`answer_ids` where an observation may also be an `Observation` (images, then text): the
        ids and the answer's images in placeholder order. Joined into one user turn, the
        observations show all their images first."""
        if not isinstance(observations, list):
            raise TypeError(f"StepResult.observations is a {type(observations).__name__}; an environment must "
                            "return a list of str")
        bad = next((o for o in observations if not isinstance(o, (str, Observation))), None)
        if bad is not None:
            raise TypeError(f"an observation is a {type(bad).__name__} ({bad!r:.80}); an environment must return "
                            "each observation as str (or an Observation to show images)")
        if observations and as_tool_responses:
            messages = [{"role": "tool", "content": m} for m in observations]
        elif observations:
            texts = [o.text if isinstance(o, Observation) else o for o in observations]
            images = [i for o in observations if isinstance(o, Observation) for i in o.images]
            joined = "\n\n".join(texts)
            messages = [{"role": "user", "content": Observation(joined, images) if images else joined}]
        else:
            messages = [{"role": "user", "content": continue_message}]
        return self.continuation_with_images(messages)

    def continuation_ids(self, new_messages: list[dict[str, Any]]) -> list[int]:
        """The tokens the template puts after a finished assistant turn (its end-of-turn token
        included) for `new_messages`, up to and including the next generation prompt: the
        reference conversation rendered with and without them, the difference kept."""
        return _text_only(self.continuation_with_images(new_messages), "continuation_with_images")

    def continuation_with_images(self, new_messages: list[dict[str, Any]]) -> tuple[list[int], list[Any]]:
        """`continuation_ids` of messages whose content may be an `Observation`: the ids and the
        new images in placeholder order."""
        new_messages, images = self.with_parts(new_messages)
        full = self.render([*self._base, self._assistant, *new_messages], add_generation_prompt=True)
        if not full.startswith(self._turn_prefix):
            raise TemplateError(
                "the chat template is not prefix-consistent: adding messages after an assistant turn "
                f"changes how the earlier turns render.\nbefore: {self._turn_prefix!r}\nafter: {full!r}"
            )
        return self._encode(full[len(self._turn_prefix) :], images), images

    def with_parts(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
        """`message_parts(messages)`; ValueError when there are images but no processor to encode them."""
        out, images = message_parts(messages)
        if images and self.processor is None:
            raise ValueError("an environment showed images (an Observation with images) but the model has "
                             "no processor: use a vision-language model (docs/multimodal.md)")
        return out, images

    def _encode(self, text: str, images: list[Any]) -> list[int]:
        """Ids of rendered `text`; with `images`, the processor's, which expands each placeholder
        into its image's tokens (the placeholders must be exactly one per image)."""
        placeholder = getattr(self.processor, "image_token", IMAGE_PLACEHOLDER)
        if not images and (self.processor is None or placeholder not in text):
            return self.tokenizer.encode(text, add_special_tokens=False)
        found = text.count(placeholder)
        if found != len(images):  # (a forced placeholder without its image would take another's features)
            raise ValueError(f"the rendered messages hold {found} {placeholder} placeholders for {len(images)} "
                             f"images: a message's text may not contain {placeholder} itself, and the chat "
                             "template must render one per image part")
        return list(self.processor(text=[text], images=[list(images)], add_special_tokens=False)["input_ids"][0])

    def _find_end_of_turn(self, after_content: str) -> str:
        """The special token the template writes right after an assistant turn's content."""
        eos = self.tokenizer.eos_token
        if eos and after_content.startswith(eos):
            return eos
        # Special tokens the tokenizer knows: the named ones, and added tokens marked special
        # (where a template's turn marker, e.g. <|im_end|> under eos <|endoftext|>, lives).
        known = list(self.tokenizer.all_special_tokens)
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        known += [t.content for t in added.values() if getattr(t, "special", False)]
        candidates = [t for t in known if t and after_content.startswith(t)]
        if not candidates:
            raise TemplateError(
                "cannot find the end-of-turn token: the chat template writes "
                f"{after_content[:40]!r} after an assistant turn's content, which does not start with a "
                "special token; pass end_of_turn explicitly"
            )
        return max(candidates, key=len)


def message_parts(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """`messages` as a chat template takes them: each `Observation` content as a list of parts (an
    image part per image, then the text; plain text when it has no images), image parts that hold
    their image (`{"type": "image", "image": PIL}`) without it; and all their images in order."""
    out, images = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, Observation):
            content = [{"type": "image", "image": i} for i in content.images] + [{"type": "text", "text": content.text}]
            m = {**m, "content": content if len(content) > 1 else content[0]["text"]}
        if isinstance(content, list) and any(isinstance(p, dict) and "image" in p for p in content):
            images += [p["image"] for p in content if isinstance(p, dict) and "image" in p]
            m = {**m, "content": [{"type": "image"} if isinstance(p, dict) and "image" in p else p for p in content]}
        out.append(m)
    return out, images


def _text_only(encoded: tuple[list[int], list[Any]], method: str) -> list[int]:
    """The ids of an encoding that must hold no images (the ids-only methods)."""
    ids, images = encoded
    if images:
        raise ValueError(f"these messages show {len(images)} image(s): use ChatFormat.{method}, which returns them too")
    return ids


# One ChatFormat per (tokenizer or processor, tools, end_of_turn), dropped with it.
_FORMATS: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str | None], ChatFormat]]" = weakref.WeakKeyDictionary()


def chat_format(tokenizer: Any, tools: list[dict[str, Any]] | None, end_of_turn: str | None = None) -> ChatFormat:
    """The cached `ChatFormat` of `tokenizer` with `tools` (built, and checked, on first use)."""
    key = (json.dumps(tools or None, sort_keys=True), end_of_turn)
    per_tokenizer = _FORMATS.setdefault(tokenizer, {})
    if key not in per_tokenizer:
        per_tokenizer[key] = ChatFormat(tokenizer, tools, end_of_turn)
    return per_tokenizer[key]

