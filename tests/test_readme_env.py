"""The README's Environment paragraph names exactly the tooling variables the config scan lets through."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.config_sources import NON_SETTING_ENV

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_lists_every_tooling_variable() -> None:
    text = README.read_text()
    para = text[text.index("**Environment.**"): text.index("**Checked at start.**")]
    named = set(re.findall(r"`(KVTIER_[A-Z0-9_]+)`", para)) - {"KVTIER_CPU_CAPACTY"}  # the misspelling example
    assert named == set(NON_SETTING_ENV), (sorted(named - NON_SETTING_ENV), sorted(NON_SETTING_ENV - named))
