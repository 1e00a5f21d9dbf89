"""Asynchronous training: parameter servers, workers and their coordinator
(ARCHITECTURE.md, "Asynchronous training")."""
