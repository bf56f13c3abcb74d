"""No decision of a re-tokenized turn is valued at a critic state holding text the policy had
not written before it (`shared_critic.critic_row`).

Replies are drawn from pieces that re-tokenize otherwise than they were sampled: special-token
strings (one special token to the critic), bytes SmolLM2's GGUF vocabulary has no ids for,
invalid UTF-8 (U+FFFD in the reply's text) and several scripts, each piece sampled as its
canonical tokens or byte by byte; for one tokenizer and for two. References, both in bytes
(every vocabulary here is byte-level): the characters the policy had written before token j,
its bytes so far through Python's incremental UTF-8 decoder (which holds a character back
until its bytes are complete); the characters each critic state touches, its bytes walked
along the text's characters.
"""

import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, normalizers
from transformers import PreTrainedTokenizerFast

from marft_jax.models import gguf_checkpoint, smollm2, tiny
from marft_jax.models import tokenizer as tokenizer_lib
from marft_jax.models.tokenizer import CHATML_TEMPLATE
from marft_jax.rollout.context import chat_prompt
from marft_jax.train import shared_critic
from tests.train.test_backbones import smol_tokenizer  # noqa: F401 (a fixture, found by name)
from tests.train.test_shared_critic_split import _byte_decoder, _token_bytes, _written

MESSAGES = ({"role": "system", "content": "Check it."}, {"role": "user", "content": "2 + 2?"})
SPECIAL_STRINGS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<repo_name>")
UNENCODED = ("\x04", "\x13", "\x16", "\x06", "\x1d")  # SmolLM2's GGUF: no ids
SCRIPTS = ("é", "ß", "中", "文", "😀", "→", "Ж", "ع", "한", "\ufffd")
INVALID = (b"\xff", b"\x80", b"\xc3", b"\xe4\xb8", b"\xf0\x9f\x98")


# --- references ---------------------------------------------------------------------------------


def _reached(tokenizer, ids, text) -> np.ndarray:
  """[m + 1] the characters of `text` the critic's ids[:i] touch, i = 0..m: its bytes laid
  along the text's, a character its vocabulary has no ids for holding none."""
  pieces = _token_bytes(tokenizer, ids, spell_special=True)
  stream, at, first_byte = b"".join(pieces), 0, {}  # character: its first byte in `stream`
  for k, ch in enumerate(text):
    spelled = ch.encode("utf-8")
    if stream.startswith(spelled, at):
      first_byte[k] = at
      at += len(spelled)
    else:
      assert not tokenizer(ch, add_special_tokens=False)["input_ids"], (text, ch)
  assert at == len(stream), text
  ends = np.cumsum([0] + [len(p) for p in pieces])
  return np.asarray([1 + max([k for k, b in first_byte.items() if b < end], default=-1)
                     for end in ends])


# --- replies ------------------------------------------------------------------------------------


def _piece_ids(tokenizer, piece, by_bytes: bool) -> list[int]:
  """A piece as the policy may sample it: its canonical tokens (a special-token string as
  text), or byte by byte (bytes its vocabulary has no token for left out)."""
  if isinstance(piece, str) and not by_bytes:
    return tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
  raw = piece.encode("utf-8") if isinstance(piece, str) else piece
  chars = {b: ch for ch, b in _byte_decoder().items()}
  ids = [tokenizer.convert_tokens_to_ids(chars[b]) for b in raw]
  return [i for i in ids if i is not None and i != tokenizer.unk_token_id]


PIECES = st.one_of(
    st.text(alphabet="abc xyz.,!?0123\n", min_size=1, max_size=5),
    st.sampled_from(SPECIAL_STRINGS), st.sampled_from(UNENCODED), st.sampled_from(SCRIPTS),
    st.sampled_from(INVALID), st.just(None))  # None: the policy samples <|im_start|> itself
REPLIES = st.lists(st.tuples(PIECES, st.booleans()), min_size=1, max_size=12)


def _reply_ids(tokenizer, pieces) -> list[int]:
  ids = []
  for piece, by_bytes in pieces:
    ids += ([tokenizer.convert_tokens_to_ids("<|im_start|>")] if piece is None else
            _piece_ids(tokenizer, piece, by_bytes))
  return ids


# --- the property -------------------------------------------------------------------------------


def _check_turn(policy, critic, reply_ids):
  """Every decision's critic state touches only characters written before it, and it is the
  last critic state that does. Returns the decisions checked."""
  text = policy.decode(reply_ids, skip_special_tokens=True)
  turn = types.SimpleNamespace(role="checker", messages=MESSAGES, reply=text)
  tokens, u, aligned = shared_critic.critic_row(turn, reply_ids, policy, critic)
  prompt_len = len(chat_prompt(critic, MESSAGES))
  reached = _reached(critic, tokens[prompt_len:], text)
  written = _written(policy, reply_ids, text)
  assert aligned, text
  for j, u_j in enumerate(u):
    count = u_j - (prompt_len - 1)  # the critic's reply tokens in decision j's state
    assert reached[count] <= written[j], (text, j, count)
    assert count == np.flatnonzero(reached <= written[j]).max(), (text, j)
  return len(u)


def _counts(policy, critic, text, reply_ids) -> tuple[list[int], bool]:
  """(each decision's count of the critic's reply tokens in its state; `critic_row`'s
  aligned flag)."""
  turn = types.SimpleNamespace(role="checker", messages=MESSAGES, reply=text)
  _, u, aligned = shared_critic.critic_row(turn, reply_ids, policy, critic)
  return list(u - (len(chat_prompt(critic, MESSAGES)) - 1)), aligned


PAIRS = [("tiny", "tiny"), ("smol", "smol"), ("tiny", "smol"), ("smol", "tiny")]


@pytest.fixture(scope="module")
def vocabularies(smol_tokenizer):
  return {"tiny": tiny.tiny_tokenizer(), "smol": smol_tokenizer}


def test_a_special_token_string_or_an_unencoded_byte_is_read_once_written(vocabularies):
  """Hand-counted. One vocabulary (tiny): "ab<|im_end|>cd" sampled as text, a token a
  character; the critic reads "<|im_end|>" as one special token (characters 2-11): decisions
  2 to 11 sit after "ab", 12 after the special token, 13 after "c" (today's rule: 2 after
  the special token, 3 on after "cd"). Tiny to SmolLM2: "a\x04bc d" sampled as a, \x04, b,
  c, " ", d; SmolLM2 has no id for \x04, and its a, bc, " d" reach characters 1, 4 and 6:
  decisions 1 to 3 sit after "a", 4 and 5 after "bc" (today's: 2 to 5 after " d")."""
  tiny_vocab, smol = vocabularies["tiny"], vocabularies["smol"]
  text = "ab<|im_end|>cd"
  ids = tiny_vocab(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
  assert len(ids) == len(text)
  assert _counts(tiny_vocab, tiny_vocab, text, ids) == ([0, 1] + [2] * 10 + [3, 4], True)
  text = "a\x04bc d"
  ids = tiny_vocab(text, add_special_tokens=False)["input_ids"]
  assert tiny_vocab.convert_ids_to_tokens(ids) == ["a", "Ą", "b", "c", "Ġ", "d"]
  assert smol.convert_ids_to_tokens(smol(text, add_special_tokens=False)["input_ids"]) == \
      ["a", "bc", "Ġd"]
  assert _counts(tiny_vocab, smol, text, ids) == ([0, 1, 1, 1, 2, 2], True)


def _lowercasing(tokenizer):
  """`tokenizer` with a lowercasing normalizer: its tokens of "B" spell "b"."""
  backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
  backend.normalizer = normalizers.Lowercase()
  return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHATML_TEMPLATE,
                                 clean_up_tokenization_spaces=False)


def test_past_where_the_critic_stops_spelling_the_reply_each_decision_sits_before_it(
    vocabularies):
  """A critic that lowercases "the sky is Blue" (t, he, " s", ky, " is", " blue"): its
  tokens agree up to " is"; " blue" is not the reply's text, so decisions 5 to 8 (" ", B,
  lu, e) sit after " is" (today's rule: 7 and 8 after " blue", reading "lue"), and the turn
  is counted unaligned (`critic/unaligned_turns`)."""
  policy = vocabularies["tiny"]
  text = "the sky is Blue"
  ids = policy(text, add_special_tokens=False)["input_ids"]
  assert policy.convert_ids_to_tokens(ids) == ["t", "he", "Ġs", "ky", "Ġis", "Ġ", "B", "lu", "e"]
  assert _counts(policy, _lowercasing(policy), text, ids) == ([0, 1, 2, 3, 4, 5, 5, 5, 5], False)


@pytest.mark.parametrize("policy,critic", PAIRS)
@settings(max_examples=40, deadline=None, derandomize=True)
@given(pieces=REPLIES)
def test_no_critic_state_reaches_past_its_decision(vocabularies, policy, critic, pieces):
  policy, critic = vocabularies[policy], vocabularies[critic]
  reply_ids = _reply_ids(policy, pieces)
  if reply_ids:
    _check_turn(policy, critic, reply_ids)


def test_random_tiny_replies_re_tokenized_for_smollm2(vocabularies):
  """Replies of random tiny-vocabulary tokens (a random model's), SmolLM2's critic: the
  audit's case, where 9 % of decisions read future text."""
  policy, rng = vocabularies["tiny"], np.random.default_rng(0)
  ids = lambda n: [int(i) for i in rng.integers(len(tiny.SPECIAL_TOKENS), len(policy), n)]
  checked = sum(_check_turn(policy, vocabularies["smol"], ids(rng.integers(5, 40)))
                for _ in range(60))
  assert checked > 1000


# --- two backbones of one vocabulary ------------------------------------------------------------


@pytest.fixture(scope="module")
def twins(vocabularies):
  """Per vocabulary, a second copy of its tokenizer (a second backbone loaded from the same
  files)."""
  smol = tokenizer_lib.gguf_tokenizer(gguf_checkpoint.open_gguf(smollm2.smollm2_gguf_path()))
  return {"tiny": (vocabularies["tiny"], tiny.tiny_tokenizer()),
          "smol": (vocabularies["smol"], smol)}


@pytest.mark.parametrize("name", ["tiny", "smol"])
@settings(max_examples=30, deadline=None, derandomize=True)
@given(pieces=st.lists(st.one_of(st.text(alphabet="abc xyz.,!?0123\n", min_size=1,
                                         max_size=5), st.sampled_from(SCRIPTS)),
                       min_size=1, max_size=10))
def test_a_canonical_turn_reads_as_on_one_backbone(twins, name, pieces):
  """A split team on two backbones of one vocabulary, the turn sampled as its text's
  canonical tokens: the critic's row is the one-backbone row (its prompt's ids, then its
  own), and decision j sits at its own position, unless token j - 1 ends inside a character
  (a byte-level vocabulary's 中 is three tokens): then before that character's first token,
  where one backbone would read its bytes so far."""
  policy, critic = twins[name]
  text = "".join(pieces)
  ids = policy(text, add_special_tokens=False)["input_ids"]
  turn = types.SimpleNamespace(role="checker", messages=MESSAGES, reply=text)
  tokens, u, aligned = shared_critic.critic_row(turn, ids, policy, critic)
  prompt = chat_prompt(policy, MESSAGES)
  assert aligned and tokens == prompt + ids
  written, ends = _written(policy, ids, text), np.cumsum([0] + [
      len(b) for b in _token_bytes(policy, ids)])
  whole = [i for i in range(len(ids) + 1) if len(text[:written[i]].encode()) == ends[i]]
  np.testing.assert_array_equal(
      u, [len(prompt) - 1 + max(i for i in whole if i <= j) for j in range(len(ids))])
