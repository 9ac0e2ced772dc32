"""Cosmos-Reason1 RL rows: ``{"qa_pairs": {"question", "index2ans", "answer"}, "video": ...}``.

:func:`read_qa_pairs` checks the layout of one row and returns it cleaned:

- options whose text is null are dropped. A Hugging Face dataset stores ``index2ans`` as a
  struct whose fields are the letters of all rows together, so a row of three options
  holds ``"D": None`` after a row of four; that option is no option of the row, and must
  neither be lettered into its prompt (``D. None``) nor be a letter the policy may pick;
- the answer must name one of the options, as the ``choice`` reward and evaluation read it
  (the letter, decorated or not, the option's text, or a 0-based index): a row whose answer
  names none of them could never be scored right, so it is a bad row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reasonctl.data.row_problem import RowProblem


def read_qa_pairs(raw: Any) -> dict[str, Any]:
    """The row's ``qa_pairs`` layout (the first one of a list) with null options dropped,
    or a :class:`RowProblem` saying what is missing or inconsistent."""
    layout = raw[0] if isinstance(raw, list) and raw else raw
    if not isinstance(layout, Mapping):
        raise RowProblem(f"'qa_pairs' must be an object {{question, index2ans, answer}} or a "
                         f"list of them (got {raw!r})")
    question = layout.get("question")
    if not isinstance(question, str) or not question.strip():
        raise RowProblem(f"'qa_pairs' has no question text (keys: {', '.join(layout)})")
    answer = layout.get("answer")
    if answer is None:
        raise RowProblem("'qa_pairs' has no 'answer' (the correct option's letter or text)")
    cleaned = dict(layout)
    options = layout.get("index2ans")
    if isinstance(options, Mapping):
        cleaned["index2ans"] = options = {k: v for k, v in options.items() if v is not None}
        if options and not _names_an_option(answer, options):
            raise RowProblem(
                f"'qa_pairs' answer {answer!r} names none of its options "
                f"({', '.join(f'{k}: {v}' for k, v in options.items())}); give an option's "
                "letter or text"
            )
    return cleaned


def _names_an_option(answer: Any, options: Mapping[Any, Any]) -> bool:
    """Whether the ``choice`` reward resolves ``answer`` to one of ``options``."""
    from reasonctl.rewards.choice_answers import option_letter, read_choice

    letters = {str(k).strip().upper(): str(v) for k, v in options.items()}
    if isinstance(answer, bool):
        return False
    if isinstance(answer, int):
        return 0 <= answer < len(letters)
    text = str(answer).strip()
    if option_letter(text, letters) is not None:
        return True
    return read_choice(text, "".join(letters), letters).letter is not None
