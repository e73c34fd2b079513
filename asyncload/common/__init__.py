"""The shared core every wing imports: errors, options, stats, latency, the names a
checkpoint may give, and the sync faces' event-loop thread. Nothing here imports a wing."""
