"""Asynchronous training: parameter servers, workers and their coordinator.

A separate engine from the SPMD strategies below it: a `ClusterCoordinator`
schedules functions on workers (threads of this process, or Ray actors), and
the steps they run read and update variables held by parameter servers,
without lock-step. ARCHITECTURE.md, "Asynchronous training", walks it.
"""
