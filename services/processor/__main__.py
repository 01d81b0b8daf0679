from services.processor.app import register
from yoke.runtime.service import run_service

run_service("processor", register)
