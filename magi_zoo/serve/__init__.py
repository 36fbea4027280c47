"""`magi-zoo serve`: models kept loaded (and compiled) behind an OpenAI-compatible HTTP API.

    app.py      the FastAPI app: config, lifespan, errors, the bearer key, the body limit
    routes.py   the endpoints (OpenAI's images, videos, chat completions, models; jobs,
                health, metrics, the web page)
    schemas.py  the request bodies (pydantic)
    served.py   a served model: its endpoints, a request checked into a job (the CLI's checks)
    jobs.py     jobs: ids, status, progress, files; the job table
    pool.py     a bounded queue per model, one dispatcher per worker, restarts, shutdown
    worker.py   the worker process: loads the model, runs jobs through `magi-zoo run`'s path
    process.py  a worker process's entry point: signals, its cards, then a worker or a rank
    group.py    a worker that is a group of N processes (--nproc): rank 0 leads, the others follow
    metrics.py  Prometheus text
    static/     the web page (plain HTML and JavaScript, no build step)

Needs the `serve` extra (FastAPI, uvicorn, python-multipart, prometheus-client).
"""
