"""The chaos suite's library (tests/chaos/CONTRACT.md): a training job under elastic
(job.py), fault injectors (faults.py; faults_io.py and netns.py by other parts), the
after-scenario checks (checks.py) and the results (result.py). Standard library only."""
