"""prorsa replay: a recorded job replayed on every policy of the rollout simulator."""
