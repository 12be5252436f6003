"""An episode's life, free of any transport: its state rebuilt from turn records, its token stream, stop
rules, token budget and deadline, hints, and the turn records a harness program's calls make."""
