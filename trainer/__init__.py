"""Learning: the policy server (vLLM) and its model, and the veRL trainer that updates and republishes it."""
