from services.ingestion.app import register
from yoke.runtime.service import run_service

run_service("ingestion", register)
