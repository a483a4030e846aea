"""Stage 3: measure variants and choose one (scoring is in place; measurement lands next)."""
