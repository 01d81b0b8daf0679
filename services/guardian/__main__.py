from services.guardian.app import register
from yoke.runtime.service import run_service

run_service("guardian", register)
