"""Training ARR-COC's scorers against a frozen VLM (stage 1: relevance targets; stage 2: answers)."""
