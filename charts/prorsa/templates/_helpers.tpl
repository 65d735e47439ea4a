{{/*
Names. The operator's code selects its pod with app.kubernetes.io/name=prorsa and
app.kubernetes.io/component=operator (the shared webhook Service it creates when missing), so
the name label is fixed: only resource names follow fullnameOverride / the release name.
*/}}
{{- define "prorsa.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains "prorsa" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-prorsa" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "prorsa.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object the chart creates. */}}
{{- define "prorsa.labels" -}}
helm.sh/chart: {{ include "prorsa.chart" . }}
app.kubernetes.io/name: prorsa
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: prorsa
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The operator pod's identity: what the Deployment, the Service and the operator select. */}}
{{- define "prorsa.selectorLabels" -}}
app.kubernetes.io/name: prorsa
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "prorsa.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "prorsa.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is pinned. */}}
{{- define "prorsa.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if eq $tag "latest" -}}
{{- fail "image.tag: pin a version (e.g. the chart's appVersion), not latest" -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
Whether to render a Prometheus Operator object: "auto" renders it only when the cluster serves
the API (helm install/upgrade; helm template needs --api-versions), true always, false never.
*/}}
{{- define "prorsa.wantsMonitoringKind" -}}
{{- $enabled := index . 0 -}}
{{- $ctx := index . 1 -}}
{{- $kind := index . 2 -}}
{{- if eq (toString $enabled) "true" -}}
true
{{- else if and (eq (toString $enabled) "auto") ($ctx.Capabilities.APIVersions.Has (printf "monitoring.coreos.com/v1/%s" $kind)) -}}
true
{{- end -}}
{{- end -}}

{{/*
The operator's rules in a namespace that runs RolloutClusters (a Role there, or the
ClusterRole in all-namespaces mode). Each names the code path that needs it.
*/}}
{{- define "prorsa.namespacedRules" -}}
# The custom resource: kopf lists and watches it and patches its finalizer and progress;
# the control loop writes status.
- apiGroups: ["prorsa.io"]
  resources: ["rolloutclusters"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["prorsa.io"]
  resources: ["rolloutclusters/status"]
  verbs: ["patch"]
# Engine pods: kopf watches them; the loop lists, creates and reads them, relabels them
# during switches (role label, intent annotation) and deletes failed or surplus ones.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Created when missing, read by name: the engines' and router's Services, the Secrets (agent
# token, engine admin key, trainer token; never listed or watched), the router's
# ServiceAccount, Role, RoleBinding and Deployment.
- apiGroups: [""]
  resources: ["services", "secrets", "serviceaccounts"]
  verbs: ["get", "create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
# The learned-statistics ConfigMap: read at start, written (patch, else create) as it runs.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# Kubernetes Events about switches and handlers (kopf posts core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- if include "prorsa.wantsLeaderWorkerSets" . }}
# Multi-node instances as LeaderWorkerSets, when the operator finds the API at start-up
# (docs/multinode.md): listed every tick, created per instance, deleted when an instance
# goes or changes size. The API's discovery (GET /apis) needs no rule: every authenticated
# user may read it.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["list", "create", "delete"]
{{- end }}
{{- end -}}

{{/*
Whether the operator may manage LeaderWorkerSets: "auto" when the cluster serves
leaderworkerset.x-k8s.io/v1 (helm install/upgrade; helm template needs --api-versions),
true always, false never.
*/}}
{{- define "prorsa.wantsLeaderWorkerSets" -}}
{{- $enabled := .Values.rbac.leaderWorkerSets -}}
{{- if eq (toString $enabled) "true" -}}
true
{{- else if and (eq (toString $enabled) "auto") (.Capabilities.APIVersions.Has "leaderworkerset.x-k8s.io/v1") -}}
true
{{- end -}}
{{- end -}}

{{/* The webhook's kubernetes.io/tls Secret (webhook.tls): yours, or cert-manager's. */}}
{{- define "prorsa.webhookTlsSecret" -}}
{{- default (printf "%s-webhook-tls" (include "prorsa.fullname" .)) .Values.webhook.tls.secretName -}}
{{- end -}}

{{/* http or https: what the webhook port (8787) speaks. */}}
{{- define "prorsa.webhookScheme" -}}
{{- if .Values.webhook.tls.enabled -}}https{{- else -}}http{{- end -}}
{{- end -}}

{{/*
The namespaces whose RolloutClusters the operator handles, as a JSON list: []
(every namespace) with operator.watchAllNamespaces, else operator.watchNamespaces, else the
release namespace alone (the secure default: its engines get the NetworkPolicy).
*/}}
{{- define "prorsa.watchedNamespaces" -}}
{{- if .Values.operator.watchAllNamespaces -}}
{{- if .Values.operator.watchNamespaces -}}
{{- fail "operator.watchAllNamespaces and operator.watchNamespaces: set one of them" -}}
{{- end -}}
[]
{{- else -}}
{{- toJson (.Values.operator.watchNamespaces | default (list .Release.Namespace)) -}}
{{- end -}}
{{- end -}}

{{/*
The namespaces that get the engines' NetworkPolicy, as a JSON list: networkPolicy.namespaces,
else the watched ones. Watching every namespace, the chart cannot know where engines run:
it refuses to render until they are listed, or until networkPolicy.enabled=false says to go
without (docs/security.md#networkpolicy).
*/}}
{{- define "prorsa.fencedNamespaces" -}}
{{- $watched := include "prorsa.watchedNamespaces" . | fromJsonArray -}}
{{- $fenced := .Values.networkPolicy.namespaces | default $watched -}}
{{- if and .Values.networkPolicy.enabled (not $fenced) -}}
{{- fail "operator.watchAllNamespaces: list the namespaces that run RolloutClusters in networkPolicy.namespaces (their engines get a NetworkPolicy), or set networkPolicy.enabled=false to leave the engines' ports open (docs/security.md)" -}}
{{- end -}}
{{- toJson $fenced -}}
{{- end -}}

{{/* http or https: what the metrics port (8788) speaks (the webhook's certificate). */}}
{{- define "prorsa.metricsScheme" -}}
{{- include "prorsa.webhookScheme" . -}}
{{- end -}}
