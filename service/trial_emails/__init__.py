"""Trial-journey emails: reserve each due email exactly once, in blocks; the outbox relay sends only the winners."""
