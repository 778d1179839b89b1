"""docs/runbook.md has a section per alert, and every rule of alerts.yml links to its own section."""

import re

from tests.deploy.files import ALERTS_FILE, RUNBOOK, RUNBOOK_BASE_URL, alert_rules, github_slug, runbook_slugs


def _sections() -> dict[str, str]:
    """Each `## ` section's text by its heading."""
    parts = re.split(r"^## (.+?)\s*$", RUNBOOK.read_text(), flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_alert_links_to_its_own_section_of_the_runbook() -> None:
    rules = alert_rules()
    assert len(rules) >= 15
    slugs = runbook_slugs()
    assert len(slugs) == len(set(slugs)), "two headings with one anchor: GitHub would suffix the second"
    for rule in rules:
        url = rule["annotations"].get("runbook_url", "")
        base, _, anchor = url.partition("#")
        assert base == RUNBOOK_BASE_URL, f"{rule['alert']}: runbook_url {url!r} is not {RUNBOOK_BASE_URL}#..."
        assert anchor == github_slug(rule["alert"]), f"{rule['alert']}: links to #{anchor}, not its own section"
        assert anchor in slugs, f"{rule['alert']}: docs/runbook.md has no heading for #{anchor}"
    assert RUNBOOK_BASE_URL in ALERTS_FILE.read_text().split("groups:")[0], "alerts.yml's header names the base"
    assert RUNBOOK_BASE_URL in RUNBOOK.read_text()


def test_every_section_says_what_it_means_the_impact_how_to_check_and_fix() -> None:
    sections = _sections()
    for rule in alert_rules():
        text = sections.get(rule["alert"])
        assert text is not None, f"no `## {rule['alert']}` section"
        for part in ("**What it means.**", "**User impact.**", "**How to check.**", "**How to fix.**"):
            assert part in text, f"{rule['alert']}: no {part}"
        assert "```sh" in text, f"{rule['alert']}: no commands to check with"
    # the commands the issue names are all in the runbook
    text = RUNBOOK.read_text()
    for command in (
        "progress-service status",
        "progress-service outbox list --parked",
        "outbox redrive --parked",
        "valkey-cli -u",
        'psql "$DATABASE_URL"',
    ):
        assert command in text
